"""``python -m services.main_decode``: the remote cluster's decoder (DRC, extend-decode)."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from services.instance_flags import add_instance_flags, instance_config
from services.main_decode.config import MainDecodeConfig

DEFAULT_PORT = 50054

MAIN_DECODE = Settings(
    MainDecodeConfig,
    Flag("kv_timeout_s", "how long a request waits for its KV before failing"),
    title="main_decode",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.main_decode", description=__doc__)
    add_server_flags(p, DEFAULT_PORT)
    add_instance_flags(p, Role.MAIN_DECODE)
    MAIN_DECODE.add(p)
    return p


def config(args: argparse.Namespace) -> MainDecodeConfig:
    server = server_config(args)
    return MAIN_DECODE.build(
        args, server=server, instance=instance_config(args, Role.MAIN_DECODE, server.host)
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(parser(), argv, config)
    configure_logging("main_decode", level=cfg.server.log_level, json=cfg.server.log_json)
    from services.main_decode.server import build  # NOTE: after logging: its servicer's imports

    run(cfg.server, build(cfg))


if __name__ == "__main__":
    main()
