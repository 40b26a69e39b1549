"""``python -m services.gateway``: the front door (gRPC Generate; HTTP API)."""

from __future__ import annotations

import argparse

from pdd.http.config import HttpConfig
from pdd.routing.policy import RoutingConfig
from pdd.server import tls
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, env, server_config
from pdd.telemetry.logging import configure_logging
from services.gateway.config import GatewayConfig
from services.gateway.server import build

DEFAULT_PORT = 50050


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    parser.add_argument(
        "--kvstore", default=env("PDD_KVSTORE", "127.0.0.1:50051"), help="env PDD_KVSTORE"
    )
    parser.add_argument("--model", default=env("PDD_MODEL", "smollm2"), help="env PDD_MODEL")
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(env("PDD_HTTP_PORT", "0")),
        help="OpenAI-compatible HTTP port, 0 = off (env PDD_HTTP_PORT)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[k for k in env("PDD_API_KEYS", "").split(",") if k],
        help="accept this bearer key on /v1/* (repeatable; env PDD_API_KEYS, comma-separated); "
        "none = no authentication",
    )
    parser.add_argument(
        "--served-model-name",
        default=env("PDD_SERVED_MODEL_NAME", ""),
        help="model id of the HTTP API (default: --model)",
    )
    parser.add_argument(
        "--http-max-body-kb",
        type=int,
        default=int(env("PDD_HTTP_MAX_BODY_KB", "8192")),
        help="largest HTTP request body, larger = 413 (env PDD_HTTP_MAX_BODY_KB)",
    )
    parser.add_argument(
        "--hit-threshold",
        type=float,
        default=float(env("PDD_HIT_THRESHOLD", "0.95")),
        help="MainDecode hit rate at which the relay is skipped (env PDD_HIT_THRESHOLD)",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=int(env("PDD_LOCAL_PREFILL_TOKENS", "0")),
        help="MainDecode prefills a predicted uncached suffix this short itself: no prefill "
        "stage, no KV over the WAN (pipeline MD); 0 = off (env PDD_LOCAL_PREFILL_TOKENS)",
    )
    parser.add_argument(
        "--relay-busy-requests",
        type=int,
        default=int(env("PDD_RELAY_BUSY", "4")),
        help="relay load at which handoffs become one-shot (env PDD_RELAY_BUSY)",
    )
    parser.add_argument(
        "--stage-timeout-s", type=float, default=float(env("PDD_STAGE_TIMEOUT_S", "600"))
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the router's tie-breaks")
    # NOTE: the gateway receives prompts, not KV: a smaller gRPC message limit than the stages'.
    parser.set_defaults(max_message_mb=int(env("PDD_MAX_MESSAGE_MB", "4")))
    args = parser.parse_args(argv)
    server = server_config(args)
    http = HttpConfig(
        host=server.host,
        port=args.http_port,
        api_keys=tuple(args.api_key),
        max_body_bytes=args.http_max_body_kb * 1024,
        served_model_name=args.served_model_name,
        grace_s=server.grace_s,
        tls=tls.installed(),
    )
    config = GatewayConfig(
        server=server,
        kvstore_address=args.kvstore,
        model=args.model,
        routing=RoutingConfig(
            hit_threshold=args.hit_threshold,
            local_prefill_tokens=args.local_prefill_tokens,
            relay_busy_requests=args.relay_busy_requests,
        ),
        http=http,
        stage_timeout_s=args.stage_timeout_s,
        seed=args.seed,
    )
    configure_logging("gateway", level=config.server.log_level, json=config.server.log_json)
    run(config.server, build(config))


if __name__ == "__main__":
    main()
