"""``python -m services.relay``: RelayDecode beside prefill (fast-link KV, token handoff)."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import MS, Flag, Settings, parse_config
from pdd.serving.relay import RelayConfig
from pdd.telemetry.logging import configure_logging
from services.instance_flags import add_instance_flags, instance_config
from services.relay.config import RelayServiceConfig

DEFAULT_PORT = 50053

SERVICE = Settings(
    RelayServiceConfig,
    Flag("transports", "transports offered: auto | comma list of rdma,shm,tcp", name="fast-link"),
    title="relay",
)
RELAY = Settings(
    RelayConfig,
    Flag("catch_up_gap", "catch-up ends once MainDecode is at most this many tokens behind"),
    Flag(
        "pace_max_hold_s",
        "during a catch-up handoff stream no faster than MainDecode decodes, holding a token at "
        "most this long; 0 = off",
        unit=MS,
    ),
    Flag(
        "stream_lead_s",
        "playout lead of the relay's stream behind its computation, so the switch to MainDecode "
        "shows no stall: auto (what recent switches took) | ms | 0 = none",
        unit=MS,
        none="auto",
    ),
    title="relay",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.relay", description=__doc__)
    add_server_flags(p, DEFAULT_PORT)
    add_instance_flags(p, Role.RELAY)
    SERVICE.add(p)
    RELAY.add(p)
    return p


def config(args: argparse.Namespace) -> RelayServiceConfig:
    server = server_config(args)
    return SERVICE.build(
        args,
        server=server,
        instance=instance_config(args, Role.RELAY, server.host),
        relay=RELAY.build(args),
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(parser(), argv, config)
    configure_logging("relay", level=cfg.server.log_level, json=cfg.server.log_json)
    from services.relay.server import build  # NOTE: after logging: loads the fast-link backends

    run(cfg.server, build(cfg))


if __name__ == "__main__":
    main()
