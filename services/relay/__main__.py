"""``python -m services.relay``: RelayDecode beside prefill (fast-link KV, token handoff)."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.server.bootstrap import run
from pdd.server.flags import (
    add_engine_flags,
    add_instance_flags,
    add_server_flags,
    auto_or_ms,
    env,
    instance_config,
    server_config,
)
from pdd.telemetry.logging import configure_logging

DEFAULT_PORT = 50053


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.relay", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    add_instance_flags(parser, "relay")
    add_engine_flags(parser)
    parser.add_argument(
        "--fast-link",
        default=env("PDD_FAST_LINK", "auto"),
        help="transports offered: auto | comma list of rdma,shm,tcp (env PDD_FAST_LINK)",
    )
    parser.add_argument(
        "--catch-up-gap",
        type=int,
        default=int(env("PDD_CATCH_UP_GAP", "8")),
        help="catch-up ends once MainDecode is at most this many tokens behind (env PDD_CATCH_UP_GAP)",
    )
    parser.add_argument(
        "--pace-max-hold-ms",
        type=float,
        default=float(env("PDD_PACE_MAX_HOLD_MS", "50")),
        help="during a catch-up handoff stream no faster than MainDecode decodes, holding a "
        "token at most this long; 0 = off (env PDD_PACE_MAX_HOLD_MS)",
    )
    parser.add_argument(
        "--stream-lead-ms",
        type=auto_or_ms,
        default=env("PDD_STREAM_LEAD_MS", "auto"),
        help="playout lead of the relay's stream behind its computation, so the switch to "
        "MainDecode shows no stall: auto (what recent switches took) | ms | 0 = none "
        "(env PDD_STREAM_LEAD_MS)",
    )
    args = parser.parse_args(argv)
    server = server_config(args)
    configure_logging("relay", level=server.log_level, json=server.log_json)
    from pdd.serving.relay import RelayConfig  # NOTE: after logging: imports torch
    from services.relay.config import RelayServiceConfig
    from services.relay.server import build

    config = RelayServiceConfig(
        server=server,
        instance=instance_config(args, Role.RELAY),
        relay=RelayConfig(
            catch_up_gap=args.catch_up_gap,
            pace_max_hold_s=args.pace_max_hold_ms / 1000,
            stream_lead_s=None if args.stream_lead_ms is None else args.stream_lead_ms / 1000,
        ),
        transports=args.fast_link,
    )
    run(config.server, build(config))


if __name__ == "__main__":
    main()
