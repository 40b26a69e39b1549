"""TLS settings: validation, flags/env, and the certificates ``make certs`` writes."""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest

from pdd.server import tls
from pdd.server.flags import add_server_flags, server_config, tls_config
from pdd.server.tls import TlsConfig
from pdd.tools import certs


def test_plaintext_unless_a_file_is_named():
    assert not TlsConfig().enabled and not TlsConfig(health_port=50061).enabled
    assert TlsConfig(ca="ca.crt").enabled and TlsConfig(cert="s.crt", key="s.key").enabled


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cert="a.crt"), "go together"),
        (dict(key="a.key"), "go together"),
        (dict(cert="a.crt", key="a.key", require_client_cert=True), "tls_client_auth"),
        (dict(ca="ca.crt", require_client_cert=True), "tls_client_auth"),
        (dict(server_name="pdd.internal"), "tls_server_name"),
        (dict(health_port=70000), "health_port"),
    ],
)
def test_invalid_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TlsConfig(**fields)


def test_unreadable_file_is_named():
    config = TlsConfig(cert="/nonexistent/a.crt", key="/nonexistent/a.key")
    with pytest.raises(ValueError, match="tls_key: cannot read /nonexistent/a.key"):
        config.server_credentials()


def test_a_server_needs_its_own_certificate():
    with pytest.raises(ValueError, match="needs --tls-cert"):
        TlsConfig(ca="ca.crt").server_credentials()


def test_server_name_becomes_the_target_name_override():
    assert TlsConfig(ca="ca.crt", server_name="pdd.internal").channel_options() == [
        ("grpc.ssl_target_name_override", "pdd.internal")
    ]
    assert TlsConfig(ca="ca.crt").channel_options() == []


def _parse(argv, monkeypatch, env=None):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_server_flags(parser, 1234)
    return parser.parse_args(argv)


def test_flags_and_env_build_the_config(monkeypatch):
    args = _parse(
        [],
        monkeypatch,
        {
            "PDD_TLS_CERT": "s.crt",
            "PDD_TLS_KEY": "s.key",
            "PDD_TLS_CA": "ca.crt",
            "PDD_TLS_CLIENT_AUTH": "true",
            "PDD_HEALTH_PORT": "50061",
        },
    )
    assert tls_config(args) == TlsConfig("s.crt", "s.key", "ca.crt", True, "", 50061)
    monkeypatch.delenv("PDD_HEALTH_PORT")
    args = _parse(
        [
            "--tls-cert",
            "x.crt",
            "--tls-key",
            "x.key",
            "--tls-ca",
            "ca.crt",
            "--no-tls-client-auth",
            "--tls-server-name",
            "pdd.internal",
        ],
        monkeypatch,
        {"PDD_TLS_CLIENT_AUTH": "true"},
    )
    assert tls_config(args) == TlsConfig("x.crt", "x.key", "ca.crt", False, "pdd.internal", 0)


def test_server_config_carries_the_tls_it_was_given(monkeypatch):
    # NOTE: no process-wide TLS state: the ServerConfig is what the service passes on.
    args = _parse(["--tls-ca", "ca.crt"], monkeypatch)
    assert server_config(args).tls == TlsConfig(ca="ca.crt")
    assert not hasattr(tls, "install") and not hasattr(tls, "installed")


def _backends():
    out = ["cryptography"]
    if shutil.which("openssl"):
        out.append("openssl")
    return out


@pytest.mark.parametrize("backend", _backends())
def test_certs_chain_to_the_ca_and_cover_every_dialled_name(tmp_path, backend):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    written = certs.generate(
        tmp_path, extra_sans=("md.example.net",), backend=backend, key_mode=0o644
    )
    assert {p.name for p in written} == {
        "ca.crt",
        "ca.key",
        *(f"{n}.{e}" for n in certs.SERVICES for e in ("crt", "key")),
    }
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "relay.key").stat().st_mode & 0o777 == 0o644
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    md = x509.load_pem_x509_certificate((tmp_path / "main-decode.crt").read_bytes())
    md.verify_directly_issued_by(ca)
    sans = md.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) >= {
        "main-decode",
        "pdd-main-decode",
        "wan-link",
        "localhost",
        certs.MESH_NAME,
        "md.example.net",
    }
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    eku = md.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    kv = x509.load_pem_x509_certificate((tmp_path / "kvstore.crt").read_bytes())
    assert "wan-link-kvstore" in kv.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_openssl_verifies_the_cryptography_backend(tmp_path):
    certs.generate(tmp_path, backend="cryptography")
    out = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(tmp_path / "ca.crt"),
            "-purpose",
            "sslserver",
            str(tmp_path / "gateway.crt"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
