"""``python -m pdd.tools.certs``: a local CA and one certificate per service (``make certs``).

For local use and tests only: the CA key sits beside the certificates. Each service gets
``<name>.crt``/``<name>.key`` signed by ``ca.crt``, usable as server *and* client certificate
(mutual TLS), whose SANs cover every name a peer dials it by:

- ``<name>`` (docker-compose), ``pdd-<name>`` (the Kubernetes Service), ``localhost``,
  ``127.0.0.1``, ``::1`` (``pdd up``, tests, container health checks);
- the WAN hop's name in front of it (``wan-link`` → main-decode, ``wan-link-kvstore`` →
  kvstore): the emulator is a TCP proxy, so TLS is end to end and the dialled name is the hop's;
- ``pdd.internal``, the shared name that ``--tls-server-name`` verifies where peers are dialled
  by IP (Kubernetes pod IPs); plus whatever ``--san`` adds (real WAN endpoints).

``openssl`` does the work when it is on PATH, else the ``cryptography`` package.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MESH_NAME = "pdd.internal"
# name → extra DNS names (the WAN hop in front of it).
SERVICES: dict[str, tuple[str, ...]] = {
    "kvstore": ("wan-link-kvstore",),
    "prefill": (),
    "relay": (),
    "main-decode": ("wan-link",),
    "gateway": (),
    # Not a service: the identity of an operator's client (pdd generate, the Node/Python clients).
    "client": (),
}
_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class CertSpec:
    name: str
    dns: tuple[str, ...]
    ips: tuple[str, ...] = _IPS

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"name: must be a plain file stem, got {self.name!r}")
        for ip in self.ips:
            ipaddress.ip_address(ip)


def specs(extra_sans: tuple[str, ...] = ()) -> list[CertSpec]:
    return [
        CertSpec(name, (name, f"pdd-{name}", *extra, "localhost", MESH_NAME, *extra_sans))
        for name, extra in SERVICES.items()
    ]


def _openssl(out: Path, certs: list[CertSpec], days: int) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        str(out / "ca.key"),
        "-out",
        str(out / "ca.crt"),
        "-days",
        str(days),
        "-subj",
        "/CN=PDD local CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    with tempfile.TemporaryDirectory() as tmp:
        for spec in certs:
            csr, ext = Path(tmp) / f"{spec.name}.csr", Path(tmp) / f"{spec.name}.ext"
            sans = ",".join([*(f"DNS:{d}" for d in spec.dns), *(f"IP:{i}" for i in spec.ips)])
            ext.write_text(
                f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={sans}\n"
            )
            run(
                "req",
                *ec,
                "-keyout",
                str(out / f"{spec.name}.key"),
                "-out",
                str(csr),
                "-subj",
                f"/CN={spec.name}",
            )
            run(
                "x509",
                "-req",
                "-in",
                str(csr),
                "-CA",
                str(out / "ca.crt"),
                "-CAkey",
                str(out / "ca.key"),
                "-set_serial",
                f"0x{secrets.token_hex(16)}",
                "-days",
                str(days),
                "-sha256",
                "-extfile",
                str(ext),
                "-out",
                str(out / f"{spec.name}.crt"),
            )


def _cryptography(out: Path, certs: list[CertSpec], days: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def write_key(key, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "PDD local CA")])
    ca = (
        builder("PDD local CA", ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_key(ca_key, out / "ca.key")
    (out / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for spec in certs:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [
            *(x509.DNSName(d) for d in spec.dns),
            *(x509.IPAddress(ipaddress.ip_address(i)) for i in spec.ips),
        ]
        cert = (
            builder(spec.name, ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write_key(key, out / f"{spec.name}.key")
        (out / f"{spec.name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


BACKENDS = {"openssl": _openssl, "cryptography": _cryptography}


def pick_backend(name: str = "auto") -> str:
    if name != "auto":
        return name
    return "openssl" if shutil.which("openssl") else "cryptography"


def generate(
    out: Path,
    *,
    extra_sans: tuple[str, ...] = (),
    days: int = 825,
    backend: str = "auto",
    key_mode: int = 0o600,
) -> list[Path]:
    """Write ``ca.{crt,key}`` and ``<service>.{crt,key}`` into ``out``; the paths written."""
    if days < 1:
        raise ValueError(f"days: must be >= 1, got {days}")
    out.mkdir(parents=True, exist_ok=True)
    certs = specs(extra_sans)
    BACKENDS[pick_backend(backend)](out, certs, days)
    written = [
        out / "ca.crt",
        out / "ca.key",
        *(out / f"{s.name}.{ext}" for s in certs for ext in ("crt", "key")),
    ]
    for path in written:
        # NOTE: the CA key stays private whatever key_mode says: no service needs it.
        os.chmod(
            path, 0o600 if path.name == "ca.key" else key_mode if path.suffix == ".key" else 0o644
        )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdd.tools.certs", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out", type=Path, default=Path("certs"), help="folder to write (default: certs/)"
    )
    parser.add_argument(
        "--san", action="append", default=[], help="extra DNS name on every certificate"
    )
    parser.add_argument("--days", type=int, default=825)
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto")
    parser.add_argument(
        "--key-mode",
        type=lambda s: int(s, 8),
        default=0o600,
        help="octal mode of the key files (644 lets a container running as another uid read "
        "a mounted key; local use only)",
    )
    args = parser.parse_args(argv)
    try:
        written = generate(
            args.out,
            extra_sans=tuple(args.san),
            days=args.days,
            backend=args.backend,
            key_mode=args.key_mode,
        )
    except subprocess.CalledProcessError as exc:
        print(f"openssl failed: {exc.stderr.decode(errors='replace')}", file=sys.stderr)
        return 1
    print(
        f"wrote {len(written)} files into {args.out} ({pick_backend(args.backend)}); CA: {args.out / 'ca.crt'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
