"""The load generator against a scripted gateway on a real grpc.aio server (port 0).

The servicer here is the test's peer, not the thing under test: it streams known
tokens with known delays (relay tokens, a handoff pause, main_decode tokens) and
known stats, so the recorded timings and fields can be checked.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pdd.bench import metrics
from pdd.bench.loadgen import LoadConfig, check_vocab, main, parse_link, run_load
from pdd.bench.record import read_records, records_path
from pdd.bench.trace import OutputSlot, TraceRequest, write_trace
from pdd.gen.common.v1 import common_pb2 as cpb
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

TTFT_S, STEP_S, HANDOFF_S, RELAY_TOKENS = 0.10, 0.02, 0.15, 3


def token(prompt: list[int], i: int) -> int:
    return 5000 + (sum(prompt) + 7 * i) % 1000


class ScriptedGateway(pb_grpc.GatewayServiceServicer):
    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.started: dict[str, float] = {}
        self.finished: dict[str, float] = {}

    async def Generate(self, request, context):
        rid = request.request_id
        prompt = list(request.prompt_token_ids.token_ids)
        self.prompts[rid] = prompt
        self.started[rid] = asyncio.get_running_loop().time()
        if rid == "bad":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        n = request.max_tokens
        out = [token(prompt, i) for i in range(n)]
        await asyncio.sleep(TTFT_S)
        for i in range(RELAY_TOKENS):
            if i:
                await asyncio.sleep(STEP_S)
            yield pb.GenerateResponse(
                token_ids=[out[i]], stage=cpb.STAGE_RELAY, start_position=i, request_id=rid
            )
        await asyncio.sleep(HANDOFF_S)
        # MD's first message re-sends the last relay token (an overlap a consumer must drop).
        yield pb.GenerateResponse(
            token_ids=out[RELAY_TOKENS - 1 : RELAY_TOKENS + 1],
            stage=cpb.STAGE_MAIN_DECODE,
            start_position=RELAY_TOKENS - 1,
            request_id=rid,
        )
        for i in range(RELAY_TOKENS + 1, n):
            await asyncio.sleep(STEP_S)
            yield pb.GenerateResponse(
                token_ids=[out[i]], stage=cpb.STAGE_MAIN_DECODE, start_position=i, request_id=rid
            )
        stats = pb.GenerateStats(
            pipeline=cpb.PIPELINE_P_RLD_MD,
            handoff_mode=cpb.HANDOFF_MODE_ONE_SHOT,
            prompt_tokens=len(prompt),
            completion_tokens=n,
            rld_tokens=RELAY_TOKENS,
            md_tokens=n - RELAY_TOKENS,
            predicted_hit_rate=0.25,
            md_cached_tokens=len(prompt) // 2,
            wan_kv_bytes=4096,
            handoff_at_token=RELAY_TOKENS,
            ttft_ms=99.0,
            wan_transfer_ms=12.5,
        )
        self.finished[rid] = asyncio.get_running_loop().time()
        yield pb.GenerateResponse(
            finish_reason=cpb.FINISH_REASON_LENGTH, stats=stats, start_position=n, request_id=rid
        )

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="scripted", vocab_size=1000, max_context_tokens=4096)


@pytest.fixture
async def gateway():
    server = grpc.aio.server()
    servicer = ScriptedGateway()
    pb_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


def session_trace() -> list[TraceRequest]:
    t0 = TraceRequest("s0-t0", "s0", 0.0, [11, 12, 13, 14], max_tokens=6, expected_hit=0.0)
    # Turn 1 = turn 0's prompt + a 6-token placeholder for its output + new text.
    t1 = TraceRequest(
        "s0-t1",
        "s0",
        10.0,
        [11, 12, 13, 14] + [1] * 6 + [21, 22],
        max_tokens=5,
        expected_hit=10 / 12,
        turn=1,
        output_slots=(OutputSlot(4, 6, "s0-t0"),),
    )
    bad = TraceRequest("bad", "s1", 5.0, [30, 31], max_tokens=4, expected_hit=0.0)
    return [t0, t1, bad]


async def test_records_timings_stages_and_stats(gateway):
    servicer, target = gateway
    run = await run_load(session_trace(), LoadConfig(target=target, progress=False))
    recs = {r.request_id: r for r in run.records}
    assert set(recs) == {"s0-t0", "s0-t1", "bad"}
    r = recs["s0-t0"]
    assert r.ok and r.output_token_ids == [token([11, 12, 13, 14], i) for i in range(6)]
    assert r.token_stages == ["relay"] * 3 + ["main_decode"] * 3
    assert r.pipeline == "p-rld-md" and r.handoff_mode == "one-shot" and r.handoff_at_token == 3
    assert r.token_stages.index("main_decode") == r.handoff_at_token
    assert (r.rld_tokens, r.md_tokens, r.wan_bytes, r.finish_reason) == (3, 3, 4096, "length")
    assert r.predicted_hit == pytest.approx(0.25) and r.actual_hit == pytest.approx(0.5)
    assert r.server_ttft_ms == 99.0 and r.wan_transfer_ms == 12.5
    # Timings: generous upper bounds for a loaded CI machine. TTFT's lower bound is tight (the server
    # sleeps TTFT_S after the client's clock started); a gap's is loose, since a late receipt of the
    # previous message (the loop busy elsewhere) shortens it, but still tells a step from the handoff.
    assert 1000 * TTFT_S * 0.95 <= r.ttft_ms < 1000 * TTFT_S + 250
    assert (
        len(r.itl_ms) == 5
    )  # six tokens in six messages (the overlap token is dropped, not a message)
    assert all(
        1000 * STEP_S * 0.5 <= x < 1000 * STEP_S + 150 for i, x in enumerate(r.itl_ms) if i != 2
    )
    assert 1000 * HANDOFF_S * 0.5 <= r.handoff_gap_ms < 1000 * HANDOFF_S + 250
    assert sum(r.itl_ms) == pytest.approx(r.token_times_ms[-1] - r.token_times_ms[0])
    assert r.handoff_gap_ms == pytest.approx(r.itl_ms[2])
    assert r.tpot_ms == pytest.approx((r.e2el_ms - r.ttft_ms) / 5)
    assert r.e2el_ms >= r.token_times_ms[-1]


async def test_next_turn_waits_and_carries_the_real_output(gateway):
    servicer, target = gateway
    run = await run_load(session_trace(), LoadConfig(target=target, progress=False))
    out0 = [token([11, 12, 13, 14], i) for i in range(6)]
    assert servicer.prompts["s0-t1"] == [11, 12, 13, 14] + out0 + [21, 22]
    assert servicer.started["s0-t1"] >= servicer.finished["s0-t0"]
    recs = {r.request_id: r for r in run.records}
    assert recs["s0-t1"].prompt_tokens == 12 and recs["s0-t1"].turn == 1
    # Without splicing the placeholder goes out as it is.
    await run_load(
        session_trace()[:2], LoadConfig(target=target, progress=False, fill_outputs=False)
    )
    assert servicer.prompts["s0-t1"] == [11, 12, 13, 14] + [1] * 6 + [21, 22]


async def test_errors_keep_code_and_message(gateway):
    _, target = gateway
    run = await run_load(session_trace(), LoadConfig(target=target, progress=False))
    bad = next(r for r in run.records if r.request_id == "bad")
    assert (bad.ok, bad.error_code, bad.error_message) == (False, "RESOURCE_EXHAUSTED", "no room")
    result = metrics.build_result("pdd", run.records, run.duration_s, slo="ttft_ms:10000")
    assert (result["requests"], result["errors"]) == (3, 1)
    assert result["pipelines"] == {"p-rld-md": 2} and result["wan_bytes"] == 8192
    assert result["rld_token_share"] == pytest.approx(6 / 11)
    assert set(result["outputs"]) == {"s0-t0", "s0-t1"}


async def test_bounded_by_count_and_wall_time(gateway):
    _, target = gateway
    trace = [
        TraceRequest(f"r{i}", f"r{i}", ts, [40 + i], max_tokens=4, expected_hit=0.0)
        for i, ts in enumerate([0.0, 100.0, 3000.0])
    ]
    run = await run_load(trace, LoadConfig(target=target, progress=False, max_requests=2))
    assert sorted(r.request_id for r in run.records) == ["r0", "r1"]
    run = await run_load(trace, LoadConfig(target=target, progress=False, max_duration_s=1.0))
    assert sorted(r.request_id for r in run.records) == ["r0", "r1"]
    assert run.duration_s < 2.5


async def test_vocab_check_refuses_out_of_range_tokens(gateway):
    _, target = gateway
    await check_vocab(target, session_trace())
    with pytest.raises(ValueError, match="vocab size 1000"):
        await check_vocab(target, [TraceRequest("x", "x", 0.0, [1000], 1, 0.0)])


async def test_cli_writes_result_and_records(gateway, tmp_path):
    _, target = gateway
    write_trace(session_trace()[:2], tmp_path / "trace.jsonl")
    out = tmp_path / "pdd.json"
    argv = [
        "run",
        "--target",
        target,
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--mode",
        "pdd",
        "--out",
        str(out),
        "--link",
        "mbps=100,delay_ms=20,name=wan",
        "--quiet",
    ]
    assert await asyncio.to_thread(main, argv) == 0
    result = json.loads(out.read_text())
    assert tuple(result) == metrics.RESULT_KEYS
    assert result["link"] == {"mbps": 100.0, "delay_ms": 20.0, "name": "wan"}
    assert result["slo"] == {"ttft_ms": 10000.0, "tpot_ms": 200.0}
    assert [r.request_id for r in read_records(records_path(out))] == ["s0-t0", "s0-t1"]


def test_config_and_link_validation():
    with pytest.raises(ValueError, match="target"):
        LoadConfig(target="")
    with pytest.raises(ValueError, match="force_pipeline"):
        LoadConfig(target="x:1", force_pipeline="p-rld")
    with pytest.raises(ValueError, match="max_requests"):
        LoadConfig(target="x:1", max_requests=0)
    with pytest.raises(ValueError, match="link"):
        parse_link("mbps")
