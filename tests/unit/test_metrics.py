"""The Prometheus series: what a request records, what is read live at scrape time."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client import REGISTRY

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.kv.stream_pool import StreamPool
from pdd.telemetry import metrics


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_finished_request_records_counts_and_latencies():
    before = {
        k: value(k, pipeline="p-rld-md")
        for k in (
            "pdd_time_to_first_token_seconds_count",
            "pdd_inter_token_latency_seconds_count",
            "pdd_e2e_request_latency_seconds_count",
        )
    }
    done = value("pdd_requests_total", pipeline="p-rld-md", outcome="length")
    relay = value("pdd_generation_tokens_total", stage="relay")
    prompt = value("pdd_prompt_tokens_total")
    t = metrics.RequestTracker()
    assert value("pdd_requests_in_flight") >= 1
    t.routed("p-rld-md", 12)
    t.tokens(1, "prefill")
    t.tokens(2, "relay")  # NOTE: several tokens in one delivery are one ITL sample
    t.tokens(1, "main_decode")
    t.finished("length")
    t.close()
    assert value("pdd_requests_total", pipeline="p-rld-md", outcome="length") == done + 1
    assert (
        value("pdd_time_to_first_token_seconds_count", pipeline="p-rld-md")
        == before["pdd_time_to_first_token_seconds_count"] + 1
    )
    assert (
        value("pdd_inter_token_latency_seconds_count", pipeline="p-rld-md")
        == before["pdd_inter_token_latency_seconds_count"] + 2
    )
    assert (
        value("pdd_e2e_request_latency_seconds_count", pipeline="p-rld-md")
        == before["pdd_e2e_request_latency_seconds_count"] + 1
    )
    assert value("pdd_generation_tokens_total", stage="relay") == relay + 2
    assert value("pdd_prompt_tokens_total") == prompt + 12
    r, md = (
        value("pdd_generation_tokens_total", stage="relay"),
        value("pdd_generation_tokens_total", stage="main_decode"),
    )
    assert value("pdd_rld_token_share") == pytest.approx(r / (r + md))


@pytest.mark.parametrize(
    ("how", "outcome", "pipeline"),
    [("close", "cancelled", "p-md"), ("fail", "error", "p-md"), ("unrouted", "error", "none")],
)
def test_requests_that_do_not_finish_are_counted_by_how_they_ended(how, outcome, pipeline):
    before = value("pdd_requests_total", pipeline=pipeline, outcome=outcome)
    inflight = value("pdd_requests_in_flight")
    t = metrics.RequestTracker()
    if how != "unrouted":
        t.routed("p-md", 3)
        t.tokens(1, "prefill")
    if how != "close":
        t.failed()
    t.close()
    assert value("pdd_requests_total", pipeline=pipeline, outcome=outcome) == before + 1
    assert value("pdd_requests_in_flight") == inflight


def test_engine_pool_and_queues_are_read_at_scrape_time():
    engine = Engine(
        tiny_model(52, num_layers=1, max_position_embeddings=64),
        EngineConfig(num_blocks=32, block_size=4, max_num_seqs=1),
    )
    metrics.LIVE.watch_engine("md-test", "main_decode", lambda: engine)
    try:
        labels = dict(role="main_decode", instance_id="md-test")
        assert value("pdd_kv_blocks_total", **labels) == 32
        assert value("pdd_kv_blocks_used", **labels) == 0
        engine.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=4))
        engine.add_request("b", list(range(1, 10)), SamplingParams(max_tokens=4))
        engine.add_request("c", [5, 6], SamplingParams(max_tokens=4), paused=True)
        engine.step()  # max_num_seqs=1: "a" runs, "b" waits
        assert value("pdd_kv_blocks_used", **labels) >= 3  # 9 prompt tokens in blocks of 4
        assert (
            value("pdd_kv_pool_usage_ratio", **labels) == value("pdd_kv_blocks_used", **labels) / 32
        )
        assert value("pdd_engine_requests", state="running", **labels) == 1
        assert value("pdd_engine_requests", state="waiting", **labels) == 1
        assert value("pdd_engine_requests", state="paused", **labels) == 1
    finally:
        metrics.LIVE.forget("md-test")
    assert (
        REGISTRY.get_sample_value(
            "pdd_kv_blocks_total", dict(role="main_decode", instance_id="md-test")
        )
        is None
    )


async def test_wan_stream_pool_occupancy():
    pool = StreamPool(1)
    metrics.LIVE.watch_pool(pool)
    base_use, base_wait = (
        value("pdd_wan_streams", state="in_use"),
        value("pdd_wan_streams", state="waiting"),
    )
    async with pool.slot():
        waiter = asyncio.create_task(pool._acquire())
        await asyncio.sleep(0)
        assert value("pdd_wan_streams", state="in_use") == base_use + 1
        assert value("pdd_wan_streams", state="waiting") == base_wait + 1
    await waiter
    pool._release()
    assert value("pdd_wan_streams", state="in_use") == base_use


def test_metrics_server_serves_the_registry():
    server, port = metrics.start_metrics_server("127.0.0.1", 0)
    try:
        metrics.HANDOFFS.labels("one-shot", "live").inc()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'pdd_handoffs_total{kind="live",mode="one-shot"}' in text
    assert "process_cpu_seconds_total" in text
