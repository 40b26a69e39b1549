"""The flags every service shares: its gRPC server and its TLS (``pdd.server.settings`` rules).

Only ``services/<name>/__main__.py`` reads flags or the environment; what it builds is a frozen
config handed to the library (``ServerConfig``, whose ``tls`` the service passes on to every
channel it opens).
"""

from __future__ import annotations

import argparse
from typing import Any

from pdd.server.config import ServerConfig
from pdd.server.cpus import parse_cpus
from pdd.server.settings import MB, Flag, Settings
from pdd.server.tls import TlsConfig

SERVER = Settings(
    ServerConfig,
    Flag("host", "bind address"),
    Flag("port", "gRPC port, 0 = any free port"),
    Flag("grace_s", "seconds in-flight calls get on SIGTERM"),
    Flag("metrics_port", "Prometheus /metrics port, 0 = off"),
    Flag("max_message_bytes", "largest gRPC message received or sent", unit=MB),
    Flag("cpus", 'CPUs every thread of the service runs on, e.g. 2-3 ("" = any)', parse=parse_cpus),
    title="server",
)
LOGGING = Settings(
    ServerConfig,
    Flag("log_level", "DEBUG | INFO | WARNING | ERROR"),
    Flag("log_json", name="log-format", choices={"json": True, "console": False}),
    title="logging",
)
HEALTH = Settings(
    TlsConfig,
    Flag(
        "health_port",
        "plaintext grpc.health.v1-only port for probes that cannot speak TLS, 0 = off",
        name="health-port",
    ),
    title="server",
)
TLS = Settings(
    TlsConfig,
    Flag("cert", "PEM certificate"),
    Flag("key", "PEM private key"),
    Flag("ca", "PEM CA that peers chain to"),
    Flag("require_client_cert", "require client certificates: mutual TLS", name="tls-client-auth"),
    Flag(
        "authorize",
        "take each RPC only from the roles that call it (the client certificate's name)",
        name="tls-authorize",
    ),
    Flag("server_name", "name outgoing channels verify instead of the dialled host"),
    prefix="tls",
    title="tls (every inter-service gRPC channel; off unless a file is named)",
)
CLIENT_TLS = Settings(
    TlsConfig,
    Flag("ca", "PEM CA the gateway's certificate chains to"),
    Flag("cert", "PEM client certificate, for a gateway that demands mutual TLS"),
    Flag("key", "its PEM private key"),
    Flag("server_name", "name to verify instead of the dialled host"),
    prefix="tls",
    title="tls to the gateway (off unless --tls-ca or --tls-cert is given)",
)


def auto_or_ms(text: str) -> float | None:
    """argparse type of a duration flag that may be learned: "auto" → None, else ms >= 0."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of ms, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_server_flags(parser: argparse.ArgumentParser, default_port: int, **defaults: Any) -> None:
    """The server's and TLS flags; ``defaults`` (ServerConfig field → value) are the service's."""
    SERVER.add(parser, port=default_port, **defaults)
    LOGGING.add(parser)
    HEALTH.add(parser)
    TLS.add(parser)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    TLS.add(parser)


def tls_config(args: argparse.Namespace) -> TlsConfig:
    """The flags' TLS settings (with the health port where ``add_server_flags`` added it)."""
    health = HEALTH.values(args) if hasattr(args, HEALTH.specs[0].dest) else {}
    return TLS.build(args, **health)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return SERVER.build(args, **LOGGING.values(args), tls=tls_config(args))


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    """TLS of a command-line client's channel to the gateway (``pdd generate``, the bench)."""
    CLIENT_TLS.add(parser)


def client_tls_config(args: argparse.Namespace) -> TlsConfig:
    """``add_client_tls_flags``' values; raises ValueError naming the flag when they clash."""
    return CLIENT_TLS.build(args)
