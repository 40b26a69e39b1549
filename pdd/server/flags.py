"""Command-line flags every service shares (each with an environment default).

Only ``services/<name>/__main__.py`` reads flags or the environment; what it
builds is a frozen config handed to the library.
"""

from __future__ import annotations

import argparse
import os

from pdd.server import tls
from pdd.server.config import ServerConfig


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


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


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default=env("PDD_HOST", "127.0.0.1"), help="bind address (env PDD_HOST)"
    )
    g.add_argument(
        "--port",
        type=int,
        default=int(env("PDD_PORT", str(default_port))),
        help="gRPC port, 0 = any free port (env PDD_PORT)",
    )
    g.add_argument(
        "--grace-s",
        type=float,
        default=float(env("PDD_GRACE_S", "5")),
        help="seconds in-flight calls get on SIGTERM (env PDD_GRACE_S)",
    )
    g.add_argument("--log-level", default=env("PDD_LOG_LEVEL", "INFO"), help="env PDD_LOG_LEVEL")
    g.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=env("PDD_LOG_FORMAT", "json"),
        help="env PDD_LOG_FORMAT",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("PDD_METRICS_PORT", "0")),
        help="Prometheus /metrics port, 0 = off (env PDD_METRICS_PORT)",
    )
    g.add_argument(
        "--max-message-mb",
        type=int,
        default=int(env("PDD_MAX_MESSAGE_MB", "64")),
        help="largest gRPC message received or sent (env PDD_MAX_MESSAGE_MB)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=int(env("PDD_HEALTH_PORT", "0")),
        help="plaintext grpc.health.v1-only port for probes that cannot speak TLS, 0 = off "
        "(env PDD_HEALTH_PORT)",
    )
    add_tls_flags(parser)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "tls (every inter-service gRPC channel; off unless a file is named)"
    )
    g.add_argument(
        "--tls-cert", default=env("PDD_TLS_CERT", ""), help="PEM certificate (env PDD_TLS_CERT)"
    )
    g.add_argument(
        "--tls-key", default=env("PDD_TLS_KEY", ""), help="PEM private key (env PDD_TLS_KEY)"
    )
    g.add_argument(
        "--tls-ca",
        default=env("PDD_TLS_CA", ""),
        help="PEM CA that peers chain to (env PDD_TLS_CA)",
    )
    g.add_argument(
        "--tls-client-auth",
        action=argparse.BooleanOptionalAction,
        default=env("PDD_TLS_CLIENT_AUTH", "false").lower() in ("1", "true", "yes"),
        help="require client certificates: mutual TLS (env PDD_TLS_CLIENT_AUTH)",
    )
    g.add_argument(
        "--tls-server-name",
        default=env("PDD_TLS_SERVER_NAME", ""),
        help="name outgoing channels verify instead of the dialled host (env PDD_TLS_SERVER_NAME)",
    )


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    """TLS of a command-line client's channel to the gateway (``pdd generate``, the bench)."""
    g = parser.add_argument_group("tls to the gateway (off unless --tls-ca or --tls-cert is given)")
    g.add_argument(
        "--tls-ca",
        default=env("PDD_TLS_CA", ""),
        help="PEM CA the gateway's certificate chains to (env PDD_TLS_CA)",
    )
    g.add_argument(
        "--tls-cert",
        default=env("PDD_TLS_CERT", ""),
        help="PEM client certificate, for a gateway that demands mutual TLS (env PDD_TLS_CERT)",
    )
    g.add_argument(
        "--tls-key", default=env("PDD_TLS_KEY", ""), help="its PEM private key (env PDD_TLS_KEY)"
    )
    g.add_argument(
        "--tls-server-name",
        default=env("PDD_TLS_SERVER_NAME", ""),
        help="name to verify instead of the dialled host (env PDD_TLS_SERVER_NAME)",
    )


def client_tls_config(args: argparse.Namespace) -> tls.TlsConfig:
    """``add_client_tls_flags``' values as a config; raises ValueError naming the flag when they clash."""
    return tls.TlsConfig(
        cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name
    )


def tls_config(args: argparse.Namespace) -> tls.TlsConfig:
    return tls.TlsConfig(
        cert=args.tls_cert,
        key=args.tls_key,
        ca=args.tls_ca,
        require_client_cert=args.tls_client_auth,
        server_name=args.tls_server_name,
        health_port=getattr(args, "health_port", 0),
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    # NOTE: the TLS settings become the process's here (every service's __main__ calls this
    # once): the bootstrap and every outgoing channel (Channels, Membership) read them.
    tls.install(tls_config(args))
    return ServerConfig(
        host=args.host,
        port=args.port,
        grace_s=args.grace_s,
        log_level=args.log_level,
        log_json=args.log_format == "json",
        metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_mb * 2**20,
    )


def add_instance_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of a serving instance (prefill, relay, main_decode)."""
    g = parser.add_argument_group("instance")
    g.add_argument(
        "--instance-id", default=env("PDD_INSTANCE_ID", f"{role}-0"), help="env PDD_INSTANCE_ID"
    )
    g.add_argument(
        "--kvstore", default=env("PDD_KVSTORE", "127.0.0.1:50051"), help="env PDD_KVSTORE"
    )
    g.add_argument(
        "--cluster",
        default=env("PDD_CLUSTER", "remote" if role == "main_decode" else "main"),
        help="env PDD_CLUSTER",
    )
    g.add_argument(
        "--advertise-address",
        default=env("PDD_ADVERTISE_ADDRESS", ""),
        help="host:port others use to reach this instance (default: the bound address)",
    )
    g.add_argument("--lease-ttl-ms", type=int, default=int(env("PDD_LEASE_TTL_MS", "6000")))


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=env("PDD_MODEL", "smollm2"),
        help="smollm2 | PATH (.gguf or HF dir) | tiny:SEED[,k=v] (env PDD_MODEL)",
    )
    g.add_argument(
        "--dtype", default=env("PDD_DTYPE", "") or None, help="compute/KV dtype (env PDD_DTYPE)"
    )
    g.add_argument(
        "--device", default=env("PDD_DEVICE", "cpu"), help="cpu | cuda[:N] | auto (env PDD_DEVICE)"
    )
    g.add_argument("--block-size", type=int, default=int(env("PDD_BLOCK_SIZE", "16")))
    g.add_argument(
        "--kv-cache-mb",
        type=int,
        default=int(env("PDD_KV_CACHE_MB", "512")),
        help="KV pool size (env PDD_KV_CACHE_MB)",
    )
    g.add_argument("--max-num-seqs", type=int, default=int(env("PDD_MAX_NUM_SEQS", "64")))
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("PDD_MAX_BATCHED_TOKENS", "2048"))
    )
    g.add_argument(
        "--threads",
        type=int,
        default=int(env("PDD_THREADS", "0")),
        help="torch intra-op threads, 0 = torch's default (env PDD_THREADS)",
    )


def engine_config(args: argparse.Namespace):
    from pdd.engine.config import EngineConfig  # NOTE: lazy: torch is heavy for non-engine services

    return EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mb * 2**20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        device=args.device,
    )


def instance_config(args: argparse.Namespace, role):
    """The ``InstanceConfig`` of an engine-bearing service from its flags."""
    from pdd.core.instance import InstanceRef
    from pdd.serving.engine_instance import InstanceConfig

    address = args.advertise_address or f"{args.host}:0"
    return InstanceConfig(
        ref=InstanceRef(args.instance_id, address, role, args.cluster),
        kvstore_address=args.kvstore,
        model=args.model,
        engine=engine_config(args),
        lease_ttl_ms=args.lease_ttl_ms,
        threads=args.threads,
    )
