"""Command-line flags every service shares (each with an environment default).

Only ``services/<name>/__main__.py`` reads flags or the environment; what it
builds is a frozen config handed to the library.
"""

from __future__ import annotations

import argparse
import os

from pdd.server.config import ServerConfig


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=env("PDD_HOST", "127.0.0.1"), help="bind address (env PDD_HOST)")
    g.add_argument("--port", type=int, default=int(env("PDD_PORT", str(default_port))),
                   help="gRPC port, 0 = any free port (env PDD_PORT)")
    g.add_argument("--grace-s", type=float, default=float(env("PDD_GRACE_S", "5")),
                   help="seconds in-flight calls get on SIGTERM (env PDD_GRACE_S)")
    g.add_argument("--log-level", default=env("PDD_LOG_LEVEL", "INFO"), help="env PDD_LOG_LEVEL")
    g.add_argument("--log-format", choices=("json", "console"), default=env("PDD_LOG_FORMAT", "json"),
                   help="env PDD_LOG_FORMAT")


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, grace_s=args.grace_s,
                        log_level=args.log_level, log_json=args.log_format == "json")
