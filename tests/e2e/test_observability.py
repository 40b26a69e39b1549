"""Operating the stack: every service's /metrics after traffic, and one request_id in every log.

The stack is the e2e one (tiny random model, every service its own process)
with the gateway's HTTP API on and a /metrics port per service. A request
enters through HTTP or gRPC with a known request_id; every service's log file
must then hold lines carrying that id, and the named series must be non-zero.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
import uuid

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd.client import generate_stream
from pdd.gen.common.v1 import common_pb2
from pdd.testbed.launcher import free_port
from pdd.testbed.stack import LinkSettings
from tests.e2e.conftest import TINY, make_stack

SERVICES = ("gateway", "kvstore", "prefill-0", "relay-0", "main_decode-0")
WAN_DELAY_MS = 150.0


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    # NOTE: a WAN delay, so that a P-RLD-MD request's first tokens are the relay's whatever the
    # machine's load: MainDecode holds the KV only after the KV's hop and the reply's (>= 2 x 150 ms).
    # Without it either stage could produce all 40 tokens (seen in CI: the relay none, then MainDecode none).
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("obs"),
        wan=LinkSettings(delay_ms=WAN_DELAY_MS),
        http_port=free_port(),
    )
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


async def http_completion(stack, tokens: list[int], request_id: str, max_tokens: int = 40) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://{stack.http_address}/v1/completions",
            headers={"X-Request-Id": request_id},
            json={
                "model": TINY,
                "prompt": tokens,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-request-id"] == request_id
            return await r.json()


async def grpc_completion(
    stack, tokens: list[int], request_id: str, max_tokens: int = 40, **fields
) -> None:
    async for _ in generate_stream(
        stack.gateway.address,
        tokens,
        max_tokens=max_tokens,
        ignore_eos=True,
        request_id=request_id,
        timeout=120,
        **fields,
    ):
        pass


def log_lines(stack, service: str) -> list[dict]:
    out = []
    for line in stack.by_name(service).log_path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def lines_of(stack, service: str, request_id: str) -> list[dict]:
    return [d for d in log_lines(stack, service) if d.get("request_id") == request_id]


@pytest.mark.parametrize("face", ["http", "grpc"])
async def test_one_request_id_is_in_every_services_log(stack, face):
    rid = f"obs-{face}-{uuid.uuid4().hex[:12]}"
    # NOTE: a fresh prompt: MainDecode holds none of it, so the request takes P-RLD-MD (every service).
    run = http_completion if face == "http" else grpc_completion
    await run(stack, prompt(hash(rid) % 10_000), rid)
    # NOTE: the client's stream can end before a service has written its closing lines (the gateway's
    # request_done, each server's rpc_finished), and the launcher copies each process's output to its
    # log file; so wait until every line asserted below is there, or the deadline.
    deadline = time.monotonic() + 10
    while True:
        found = {name: lines_of(stack, name, rid) for name in SERVICES}
        events = {name: {d["event"] for d in lines} for name, lines in found.items()}
        # NOTE: MainDecode serves the gateway's requests as calls on one shared stream
        # (DecodeMany): each call's line stands for its Decode call.
        rpcs = {
            name: {
                "Decode" if d["event"] == "decode_call_finished" else d.get("rpc")
                for d in lines
                if d["event"] in ("rpc_finished", "decode_call_finished")
            }
            for name, lines in found.items()
        }
        complete = (
            {"routed", "request_done"} <= events["gateway"]
            and "PredictHits" in rpcs["kvstore"]
            and "Prefill" in rpcs["prefill-0"]
            and {"Decode", "PrepareTransfer", "CompleteTransfer"} <= rpcs["relay-0"]
            and {"Decode", "PushKv"} <= rpcs["main_decode-0"]
        )
        if complete or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert all(found.values()), (
        f"services without a line of {rid}: {[n for n, v in found.items() if not v]}"
    )
    assert {"routed", "request_done"} <= events["gateway"]
    done = next(d for d in found["gateway"] if d["event"] == "request_done")
    assert (
        done["pipeline"] == "p-rld-md"
        and done["outcome"] == "length"
        and sum(done["tokens"].values()) == 40
    )
    assert "PredictHits" in rpcs["kvstore"]
    assert "Prefill" in rpcs["prefill-0"]
    assert {"Decode", "PrepareTransfer", "CompleteTransfer"} <= rpcs["relay-0"]
    assert {"Decode", "PushKv"} <= rpcs["main_decode-0"]
    if (
        done["tokens"].get("relay", 0) > 0
    ):  # the relay's share of TTFDT: KV arrived → import → first token
        first = next(d for d in found["relay-0"] if d["event"] == "relay_first_token")
        assert 0 <= first["import_ms"] <= first["first_token_ms"]
    for name, lines in found.items():
        assert all(d["service"] == name.split("-")[0] for d in lines), name


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples: dict, name: str) -> bool:
    return any(n == name for n, _ in samples)


async def test_metrics_endpoints_expose_the_named_series_after_traffic(stack):
    # Two turns of one session: the second hits prefill's radix cache and MainDecode's DRC.
    turn1 = prompt(7, 32)
    # NOTE: the hits asserted below are each engine's own radix cache, filled before turn 1's
    # stream ends; they do not wait on cache events reaching kvstore.
    await http_completion(stack, turn1, f"m1-{uuid.uuid4().hex[:8]}")
    await http_completion(stack, turn1 + [9, 9, 9, 9], f"m2-{uuid.uuid4().hex[:8]}")
    # NOTE: P-MD, so MainDecode's tokens are there whatever the timing (the relay's come from the others).
    await grpc_completion(
        stack, prompt(8), f"m3-{uuid.uuid4().hex[:8]}", force_pipeline=common_pb2.PIPELINE_P_MD
    )

    gw = scrape(stack.metrics["gateway"])
    assert total(gw, "pdd_requests_total", outcome="length") >= 3
    for h in (
        "pdd_time_to_first_token_seconds_count",
        "pdd_inter_token_latency_seconds_count",
        "pdd_e2e_request_latency_seconds_count",
    ):
        assert total(gw, h) >= 3, h
    assert total(gw, "pdd_generation_tokens_total", stage="relay") > 0
    assert total(gw, "pdd_generation_tokens_total", stage="main_decode") > 0
    assert 0 < total(gw, "pdd_rld_token_share") < 1
    assert total(gw, "pdd_http_requests_total", route="/v1/completions", code="200") >= 2
    assert total(gw, "pdd_grpc_server_handled_total", grpc_method="Generate", grpc_code="OK") >= 1
    # the HTTP port serves the same registry
    http = scrape(stack.http_address)
    assert total(http, "pdd_requests_total") == total(gw, "pdd_requests_total")

    p = scrape(stack.metrics["prefill-0"])
    assert total(p, "pdd_prefix_cache_queries_total", role="prefill") > 0
    assert total(p, "pdd_prefix_cache_hits_total", role="prefill") > 0
    assert total(p, "pdd_wan_kv_bytes_total", side="sent") > 0
    assert total(p, "pdd_wan_kv_transfer_seconds_count", side="sent") >= 3
    assert total(p, "pdd_wan_kv_queue_seconds_count") >= 3
    assert total(p, "pdd_fast_link_kv_bytes_total") > 0
    assert has(p, "pdd_wan_streams")
    assert total(p, "pdd_kv_blocks_total", role="prefill") > 0
    assert total(p, "pdd_kv_blocks_used", role="prefill") > 0  # the radix cache keeps prompt blocks

    r = scrape(stack.metrics["relay-0"])
    assert total(r, "pdd_handoffs_total") >= 3
    # every live handoff's switch is timed (the playout lead is learned from it)
    assert total(r, "pdd_relay_switch_seconds_count") == total(r, "pdd_handoffs_total", kind="live")
    assert has(r, "pdd_engine_requests")

    md = scrape(stack.metrics["main_decode-0"])
    assert total(md, "pdd_prefix_cache_queries_total", role="main_decode") > 0
    assert total(md, "pdd_prefix_cache_hits_total", role="main_decode") > 0
    assert total(md, "pdd_wan_kv_bytes_total", side="received") == total(
        p, "pdd_wan_kv_bytes_total", side="sent"
    )
    assert total(md, "pdd_wan_kv_transfer_seconds_count", side="received") >= 3
    assert 0 < total(md, "pdd_kv_pool_usage_ratio", role="main_decode") <= 1
    assert has(md, "pdd_engine_requests")
    assert total(md, "pdd_gc_pause_seconds_count") > 0  # every collection after start-up is timed

    # pdd up's engines share this host's cores: each stepped under the turn lock (PDD_CORE_TURNS)
    for samples, role in ((p, "prefill"), (r, "relay"), (md, "main_decode")):
        assert total(samples, "pdd_engine_core_turn_wait_seconds_total", role=role) > 0, role

    kv = scrape(stack.metrics["kvstore"])
    assert (
        total(kv, "pdd_grpc_server_handled_total", grpc_method="PredictHits", grpc_code="OK") >= 3
    )
    assert total(kv, "process_cpu_seconds_total") > 0
