"""``python -m services.main_decode``: the remote cluster's decoder (DRC, extend-decode)."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.server.bootstrap import run
from pdd.server.flags import (
    add_engine_flags,
    add_instance_flags,
    add_server_flags,
    env,
    instance_config,
    server_config,
)
from pdd.telemetry.logging import configure_logging

DEFAULT_PORT = 50054


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.main_decode", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    add_instance_flags(parser, "main_decode")
    add_engine_flags(parser)
    parser.add_argument("--kv-timeout-s", type=float, default=float(env("PDD_KV_TIMEOUT_S", "600")))
    args = parser.parse_args(argv)
    server = server_config(args)
    configure_logging("main_decode", level=server.log_level, json=server.log_json)
    from services.main_decode.config import MainDecodeConfig  # NOTE: after logging: imports torch
    from services.main_decode.server import build

    config = MainDecodeConfig(
        server=server,
        instance=instance_config(args, Role.MAIN_DECODE),
        kv_timeout_s=args.kv_timeout_s,
    )
    run(config.server, build(config))


if __name__ == "__main__":
    main()
