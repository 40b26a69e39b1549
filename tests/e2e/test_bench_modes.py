"""``pdd bench`` end to end: a tiny agentic trace through PDD on a stack the bench starts itself.

Every service is its own process (``pdd.testbed.stack``), the two clusters pinned to
separate CPUs. The RESULT must carry every contract field, no errors, PDD's
pipelines (MainDecode starts cold, so the first turns go P-RLD-MD), CPU per
service and cluster — and greedy outputs equal to a single in-process engine's
on the same prompts (later turns embed earlier outputs), up to an explicit
near-tie (``Oracle``). One stack only: start-up dominates this test's time.
"""

from __future__ import annotations

from pdd import cli
from pdd.bench.metrics import RESULT_KEYS, read_result
from pdd.bench.record import read_records, records_path
from pdd.bench.trace import TraceConfig, generate, write_trace
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.serving.model_spec import load_model

MODEL = "tiny:3,vocab=512,hidden=64,inter=128,layers=2,heads=4,kv_heads=2,ctx=1024"
BLOCK = 8


def test_bench_pdd_mode_on_its_own_stack(tmp_path, redis_url, llama_oracle):
    trace = generate(
        TraceConfig(
            sessions=3,
            turns=2,
            rps=0.0,
            seed=4,
            prompt_tokens=256,
            max_context_tokens=1024,
            output_scale=20.0,
            vocab_high=512,
            concurrent_sessions=3,
        )
    )
    write_trace(trace, tmp_path / "trace.jsonl")
    out = tmp_path / "pdd.json"
    code = cli.main(
        [
            "bench",
            "--trace",
            str(tmp_path / "trace.jsonl"),
            "--mode",
            "pdd",
            "--out",
            str(out),
            "--redis-url",
            redis_url,
            "--timeout",
            "60",
            "--quiet",
            "--model",
            MODEL,
            "--block-size",
            str(BLOCK),
            "--kv-cache-mb",
            "16",
            "--wan-mbps",
            "2",
            "--wan-delay-ms",
            "2",
            "--wan-jitter-ms",
            "1",
        ]
    )
    logs = tmp_path / "pdd-logs"
    assert code == 0, f"pdd bench failed; service logs in {logs}"
    assert (logs / "relay-0.log").exists() and (logs / "main_decode-0.log").exists()

    result = read_result(out)
    assert tuple(result) == RESULT_KEYS
    assert (result["mode"], result["requests"], result["errors"]) == ("pdd", len(trace), 0)
    assert result["ttft_ms"]["p50"] > 0 and result["ttfdt_ms"]["p50"] > 0
    # MainDecode's DRC starts empty: the first turns hit nothing there and go through the relay.
    assert result["pipelines"].get("p-rld-md", 0) >= 1 and result["rld_token_share"] > 0
    assert result["link"] == {
        "mbps": 2.0,
        "delay_ms": 2.0,
        "jitter_ms": 1.0,
        "relays": 1,
        "model": MODEL,
    }
    assert result["wan_bytes"] > 0
    cpu = result["cpu"]
    assert cpu["services"]["relay-0"] is not None and cpu["services"]["main_decode-0"] > 0
    assert set(cpu["clusters"]) == {"main", "remote"} and cpu["machine_busy"] > 0

    records = {r.request_id: r for r in read_records(records_path(out))}
    assert set(records) == {r.request_id for r in trace} and all(r.ok for r in records.values())
    # The same prompts the bench sent (earlier outputs spliced in), through one in-process engine.
    ckpt = load_model(MODEL)
    reference, oracle = Engine(ckpt, EngineConfig(block_size=BLOCK)), llama_oracle(ckpt)
    outputs = {rid: r.output_token_ids for rid, r in records.items()}
    for req in trace:
        prompt = req.prompt_with_outputs(outputs)
        assert records[req.request_id].prompt_tokens == len(prompt)
        ref = reference.generate(
            [prompt], SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        )[0]
        oracle.assert_greedy_equal(prompt, outputs[req.request_id], ref)
