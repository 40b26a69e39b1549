"""``python -m services.kvstore``: the prefix index (Redis-backed)."""

from __future__ import annotations

import argparse

from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, env, server_config
from pdd.telemetry.logging import configure_logging
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

DEFAULT_PORT = 50051


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    parser.add_argument(
        "--redis-url",
        default=env("PDD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="env PDD_REDIS_URL",
    )
    parser.add_argument(
        "--key-prefix", default=env("PDD_KEY_PREFIX", "pdd"), help="env PDD_KEY_PREFIX"
    )
    args = parser.parse_args(argv)
    config = KvstoreConfig(
        server=server_config(args), redis_url=args.redis_url, key_prefix=args.key_prefix
    )
    configure_logging("kvstore", level=config.server.log_level, json=config.server.log_json)
    run(config.server, build(config))


if __name__ == "__main__":
    main()
