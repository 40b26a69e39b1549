"""TLS (and optional mutual TLS) for every gRPC hop between PDD services.

Life: a service's ``__main__`` parses ``--tls-cert/--tls-key/--tls-ca/--tls-client-auth``
(env ``PDD_TLS_*``, see ``pdd.server.flags``) into a ``TlsConfig``, carried by its
``ServerConfig.tls`` → the bootstrap listens with ``server_credentials()`` → the service's
``build()`` hands the same config to every outgoing channel it makes
(``pdd.serving.channels.Channels``, ``pdd.serving.membership``), opened by ``open_channel``
with ``channel_credentials()``, presenting the service's own certificate when the peer asks
for one (mutual TLS). Naming no file leaves everything plaintext (tests, ``pdd up``).

The WAN emulator is a TCP proxy: TLS passes through it end to end, so the name a client
verifies is the one it dialled (e.g. ``wan-link``) — the certificate's SANs must cover it,
or ``server_name`` overrides the verified name (``grpc.ssl_target_name_override``), e.g.
when peers advertise pod IPs.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    # PEM paths; "" = not given. cert + key: this process's identity (server, and client for mTLS).
    cert: str = ""
    key: str = ""
    # PEM CA bundle that peers' certificates must chain to; "" = the system roots (clients only).
    ca: str = ""
    # Servers refuse clients that present no certificate signed by ``ca`` (mutual TLS).
    require_client_cert: bool = False
    # Outgoing channels verify this name instead of the dialled host; "" = the dialled host.
    server_name: str = ""
    # NOTE: kubelet's native gRPC probes cannot speak TLS; when > 0 a second, plaintext
    # listener on this port serves grpc.health.v1 only (no other service, no data).
    health_port: int = 0
    # Servers take each RPC only from the roles that call it in a request's life, the role being
    # the caller's certificate name (``pdd.server.authorization``); needs mutual TLS.
    authorize: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls: --tls-cert and --tls-key go together (got only one of them)")
        if self.require_client_cert and not (self.cert and self.ca):
            raise ValueError(
                "tls_client_auth: needs --tls-cert, --tls-key and --tls-ca (the CA clients must chain to)"
            )
        if self.authorize and not self.require_client_cert:
            raise ValueError(
                "tls_authorize: needs mutual TLS (--tls-client-auth): the role is read from the "
                "client's certificate"
            )
        if self.server_name and not self.enabled:
            raise ValueError(
                "tls_server_name: only meaningful with TLS on (--tls-ca or --tls-cert)"
            )
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port: must be in 0..65535, got {self.health_port}")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert:
            raise ValueError(
                "tls: a server needs --tls-cert and --tls-key (only --tls-ca was given)"
            )
        return grpc.ssl_server_credentials(
            [(_read(self.key, "key"), _read(self.cert, "cert"))],
            root_certificates=_read(self.ca, "ca") if self.ca else None,
            require_client_auth=self.require_client_cert,
        )

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The same identity for the service's HTTP listeners (OpenAI API, /metrics); None when plaintext.

        TLS 1.2 or newer; with ``require_client_cert`` a client must present a certificate
        signed by ``ca``, as on the gRPC port.
        """
        if not self.cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.ca:
                ctx.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"tls: cannot load {self.cert} / {self.key} / {self.ca or '-'}: {exc}"
            ) from exc
        ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        return ctx

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "ca") if self.ca else None,
            private_key=_read(self.key, "key") if self.key else None,
            certificate_chain=_read(self.cert, "cert") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"tls_{what}: cannot read {path}: {exc.strerror}") from exc


# What ``open_channel`` returns, named so that callers above need not import grpc themselves.
Channel = grpc.aio.Channel


def open_channel(
    address: str, config: TlsConfig, options: Sequence[tuple[str, object]] = ()
) -> Channel:
    """An asyncio channel to ``address``: TLS when ``config`` is on, plaintext otherwise."""
    if not config.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, config.channel_credentials(), options=[*options, *config.channel_options()]
    )


def add_port(server: grpc.aio.Server, address: str, config: TlsConfig) -> int:
    """Bind ``address`` on ``server`` (TLS when ``config`` is on); the bound port, 0 if none."""
    if config.enabled:
        return server.add_secure_port(address, config.server_credentials())
    return server.add_insecure_port(address)
