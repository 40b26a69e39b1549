"""``python -m services.gateway``: the front door (gRPC Generate; HTTP API)."""

from __future__ import annotations

import argparse

from pdd.routing.policy import RoutingConfig
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, env, server_config
from pdd.telemetry.logging import configure_logging
from services.gateway.config import GatewayConfig
from services.gateway.server import build

DEFAULT_PORT = 50050


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    parser.add_argument("--kvstore", default=env("PDD_KVSTORE", "127.0.0.1:50051"), help="env PDD_KVSTORE")
    parser.add_argument("--model", default=env("PDD_MODEL", "smollm2"), help="env PDD_MODEL")
    parser.add_argument("--http-port", type=int, default=int(env("PDD_HTTP_PORT", "0")),
                        help="OpenAI-compatible HTTP port, 0 = off (env PDD_HTTP_PORT)")
    parser.add_argument("--hit-threshold", type=float, default=float(env("PDD_HIT_THRESHOLD", "0.95")),
                        help="MainDecode hit rate at which the relay is skipped (env PDD_HIT_THRESHOLD)")
    parser.add_argument("--relay-busy-requests", type=int, default=int(env("PDD_RELAY_BUSY", "4")),
                        help="relay load at which handoffs become one-shot (env PDD_RELAY_BUSY)")
    parser.add_argument("--stage-timeout-s", type=float, default=float(env("PDD_STAGE_TIMEOUT_S", "600")))
    parser.add_argument("--seed", type=int, default=None, help="seed of the router's tie-breaks")
    args = parser.parse_args(argv)
    config = GatewayConfig(server=server_config(args), kvstore_address=args.kvstore, model=args.model,
                           routing=RoutingConfig(hit_threshold=args.hit_threshold,
                                                 relay_busy_requests=args.relay_busy_requests),
                           http_port=args.http_port, stage_timeout_s=args.stage_timeout_s, seed=args.seed)
    configure_logging("gateway", level=config.server.log_level, json=config.server.log_json)
    run(config.server, build(config))


if __name__ == "__main__":
    main()
