"""``python -m services.gateway``: the front door (gRPC Generate; HTTP API)."""

from __future__ import annotations

import argparse

from pdd.http.config import HttpConfig
from pdd.routing.policy import RoutingConfig
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import KB, MB, Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from services.gateway.config import GatewayConfig
from services.gateway.server import build

DEFAULT_PORT = 50050
# NOTE: the gateway receives prompts, not KV: a smaller gRPC message limit than the stages'.
MAX_MESSAGE_BYTES = 4 * MB.factor

GATEWAY = Settings(
    GatewayConfig,
    Flag("kvstore_address", "host:port of kvstore", name="kvstore"),
    Flag("model", "smollm2 | PATH (.gguf or HF dir) | tiny:SEED[,k=v]"),
    Flag("stage_timeout_s", "longest wait for a stage (prefill, relay, MainDecode)"),
    Flag(
        "index_timeout_s",
        "deadline of each kvstore call; past it, route from the last known instances",
    ),
    Flag("seed", "seed of the router's tie-breaks ('' = random)"),
    Flag(
        "max_migrations",
        "times one request may move to another MainDecode when its MainDecode or prefill is "
        "lost mid-request; 0 = never",
    ),
    Flag(
        "kv_deadline_s",
        "seconds a P-MD request's first token waits for MainDecode's KV (a partitioned WAN) "
        "before a relay takes the request over; 0 = never",
    ),
    Flag(
        "max_in_flight",
        "requests generated at once; beyond, RESOURCE_EXHAUSTED (HTTP 429) at once",
    ),
    Flag(
        "adaptive_in_flight",
        "bound the requests in flight by the latency the stack adds when it queues (refusing "
        "a burst's excess before it runs into its deadline), --max-in-flight the ceiling; "
        "off = --max-in-flight alone",
    ),
    Flag(
        "admission_wait_s",
        "seconds a request finding the bound reached may wait for a place (FIFO, while the line "
        "moves) before RESOURCE_EXHAUSTED (HTTP 429); 0 = refused at once",
    ),
    Flag(
        "wan_kv_value_bytes",
        "bytes of one KV value on the WAN as prefill sends it (its --wan-dtype: 2 bfloat16 or "
        "float16, 1 float8_e4m3); 0 = the model's dtype",
    ),
    Flag(
        "shared_decode_stream",
        "send every request to one MainDecode on one shared stream (what one engine step made "
        "for all of them in one message); off = a Decode call per request",
    ),
    title="gateway",
)
HTTP = Settings(
    HttpConfig,
    Flag("port", "OpenAI-compatible HTTP port, 0 = off"),
    Flag(
        "api_keys",
        "accept this bearer key on /v1/* (repeatable; env: comma-separated); key:tenant also "
        "names its tenant, whose cache salt its requests carry; none = no authentication",
        name="api-keys",
        aliases=("api-key",),
    ),
    Flag("served_model_name", "model id of the HTTP API ('' = --model)", name="served-model-name"),
    Flag("max_body_bytes", "largest HTTP request body, larger = 413", unit=KB),
    prefix="http",
    title="http api",
)
ROUTING = Settings(
    RoutingConfig,
    Flag("hit_threshold", "MainDecode hit rate at which the relay is skipped"),
    Flag(
        "local_prefill_tokens",
        "MainDecode prefills a predicted uncached suffix this short itself: no prefill stage, "
        "no KV over the WAN (pipeline MD); 0 = off",
    ),
    Flag("relay_busy_requests", "relay load at which handoffs become one-shot"),
    Flag(
        "pipeline_policy",
        "link_aware: through the relay only when the KV delta's estimated transfer on the "
        "chosen MainDecode's link exceeds the TTFT budget (θ while the link is unmeasured); "
        "threshold: the fixed θ on the predicted hit (--hit-threshold)",
    ),
    Flag(
        "ttft_budget_ratio",
        "link_aware: the budget in units of the gateway's recent median TTFT (prefill's first "
        "token, no transfer in it); 0 = --ttft-budget-s always",
    ),
    Flag(
        "ttft_budget_s",
        "link_aware: the budget in seconds until a TTFT was measured, or always with ratio 0",
    ),
    Flag("relay_max_requests", "requests at which a relay is full (then P-MD instead)"),
    Flag("relay_max_kv_usage", "KV pool usage above which a relay is full; 1 = never by KV"),
    title="routing",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_server_flags(p, DEFAULT_PORT, max_message_bytes=MAX_MESSAGE_BYTES)
    GATEWAY.add(p)
    HTTP.add(p)
    ROUTING.add(p)
    return p


def config(args: argparse.Namespace) -> GatewayConfig:
    server = server_config(args)
    http = HTTP.build(args, host=server.host, grace_s=server.grace_s, tls=server.tls)
    return GATEWAY.build(args, server=server, http=http, routing=ROUTING.build(args))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(parser(), argv, config)
    configure_logging("gateway", level=cfg.server.log_level, json=cfg.server.log_json)
    run(cfg.server, build(cfg))


if __name__ == "__main__":
    main()
