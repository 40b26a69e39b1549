"""``python -m services.token_flood``: a MainDecode stand-in that streams tokens as fast as it
can, the load of ``pdd bench gateway`` (testbed only, never deployed); see ``server``."""

from __future__ import annotations

import argparse

from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from services.token_flood.config import TokenFloodConfig
from services.token_flood.server import build

DEFAULT_PORT = 50059

FLOOD = Settings(
    TokenFloodConfig,
    Flag("kvstore", "kvstore host:port to register with"),
    Flag("instance_id", "instance id it registers as (a MainDecode)"),
    Flag("advertise", "host:port the gateway dials ('' = 127.0.0.1 and the bound port)"),
    Flag("cluster", "remote cluster it registers in"),
    Flag("tokens_per_message", "output tokens per Decode message"),
    Flag("vocab_size", "token ids are drawn below this"),
    title="token flood",
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.token_flood", description=__doc__)
    add_server_flags(p, DEFAULT_PORT)
    FLOOD.add(p)
    args, server = parse_config(p, argv, lambda a: (a, server_config(a)))
    configure_logging("token_flood", level=server.log_level, json=server.log_json)
    try:
        config = TokenFloodConfig(server=server, **FLOOD.values(args))
    except ValueError as exc:
        p.error(str(exc))
    run(config.server, build(config))


if __name__ == "__main__":
    main()
