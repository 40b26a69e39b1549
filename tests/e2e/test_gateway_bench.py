"""``pdd bench gateway`` end to end: kvstore, the token-flood stage and the gateway as their own
processes; every token both doors streamed is checked, and the gateway's CPU is accounted."""

from __future__ import annotations

import asyncio
import json

from pdd.bench import gateway_bench


def test_both_doors_stream_every_flood_token_and_the_gateway_cpu_is_counted(tmp_path):
    out = tmp_path / "gw.json"
    code = gateway_bench.main(
        [
            "--seconds", "1", "--concurrency", "4", "--output-len", "32",
            "--tokens-per-message", "1,4", "--json", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert code == 0, [r["errors"][:3] for r in rows]
    assert [(r["door"], r["streams"], r["tokens_per_message"]) for r in rows] == [
        (door, streams, k)
        for k in (1, 4)
        for streams in ("shared", "each")
        for door in ("grpc", "http")
    ]
    for r in rows:
        assert r["requests"] >= 4 and r["tokens"] == 32 * r["requests"] and not r["errors"]
        assert r["gateway_cpu_s"] > 0 and r["tokens_per_core_s"] > 0
        # at most one message per token; four tokens a flood message: at most 8 per request
        # (the gateway may join more when its client falls behind)
        if r["tokens_per_message"] == 1:
            assert r["messages"] <= r["tokens"]
        else:
            assert r["messages"] <= 8 * r["requests"]


def test_the_flood_stage_refuses_what_it_does_not_serve(tmp_path):
    """A P-MD request: the flood stage, asked to decode it, refuses naming the field (it serves
    pipeline MD only; listed as a prefill too, it is never a real one). Asked directly: through
    the gateway, a prefill call to it (which it does not serve) may fail first and move the
    request to pipeline MD, which it does serve."""
    import grpc

    from pdd.core.pipeline import Pipeline
    from pdd.core.sampling_params import SamplingParams
    from pdd.core.stage_events import DecodeJob
    from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
    from pdd.wire import main_decode as conv

    bench = gateway_bench.Bench(gateway_bench.GatewayBenchConfig(log_dir=str(tmp_path)))
    bench.start()
    try:
        bench.flood_with(1)
        job = DecodeJob("r", (1, 2, 3), SamplingParams(max_tokens=4), "", Pipeline.P_MD)

        async def call() -> tuple[grpc.StatusCode, str]:
            async with grpc.aio.insecure_channel(bench.flood.address) as ch:
                try:
                    stub = pb_grpc.MainDecodeServiceStub(ch)
                    async for _ in stub.Decode(conv.job_to_pb(job), timeout=30):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

        code, details = asyncio.run(call())
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "pipeline" in details, details
    finally:
        bench.stop()
