"""``pdd bench served``'s budget table: a round's hops from the client's token times and the
services' logs, and the per-token budget the 1.2× target leaves."""

from __future__ import annotations

import json

import pytest

from pdd.bench.record import RequestResult
from pdd.bench.served import make_round, summarize
from pdd.bench.served_budget import budget_table, logged_hops, request_hops


def _rec(rid: str, times: list[float], e2el: float | None = None) -> RequestResult:
    rec = RequestResult(request_id=rid, output_token_ids=list(range(len(times))))
    rec.token_times_ms = list(times)
    rec.ttft_ms = times[0] if times else None
    rec.e2el_ms = e2el if e2el is not None else (times[-1] + 1 if times else None)
    return rec


def test_request_hops_are_the_handoff_and_the_decode_interval_after_it():
    # first token at 100 ms, the second 80 ms later, then one every 10 ms
    assert request_hops(_rec("a", [100, 180, 190, 200, 210])) == (80, 10)
    # tokens that arrived in one message share a time: the interval is still the mean
    assert request_hops(_rec("b", [100, 150, 170, 170, 190])) == (50, pytest.approx(40 / 3))
    assert request_hops(_rec("c", [100, 150])) == (50, None)
    assert request_hops(_rec("d", [100])) == (None, None)


def test_a_round_and_its_summary_carry_the_hops():
    recs = [_rec("a", [100, 180, 190, 200]), _rec("b", [120, 140, 160, 180])]
    failed = _rec("c", [100, 500, 510, 520])
    failed.error_code = "UNAVAILABLE"
    r = make_round("grpc-p-md", 3, 1.0, [*recs, failed], {"gateway": 0.1}, output_len=4)
    assert r.handoff_ms == (80, 20) and r.decode_ms == (10, 20)  # the failed one left out
    s = summarize([r])
    assert s["handoff_p50_ms"] == pytest.approx(50) and s["decode_p50_ms"] == pytest.approx(15)


def test_logged_hops_reads_the_services_durations_of_the_rounds_requests(tmp_path):
    def line(rid: str, event: str, **fields) -> str:
        return json.dumps({"event": event, "request_id": rid, "service": "x", **fields})

    (tmp_path / "prefill-0.log").write_text(
        "\n".join(
            [
                line("n16r0-grpc-p-md-0", "prefilled", prefill_ms=300.0),
                line("n16r0-grpc-p-md-1", "prefilled", prefill_ms=340.0),
                line("n16r0-http-p-md-0", "prefilled", prefill_ms=999.0),  # another contender
                line("n16r0-grpc-p-md-0", "wan_pushed", queue_ms=0.0, elapsed_ms=20.0),
                line("n16r0-grpc-p-md-1", "wan_pushed", queue_ms=10.0, elapsed_ms="?"),
                "not json, a traceback line",
            ]
        )
    )
    (tmp_path / "main_decode-0.log").write_text(
        line("n16r0-grpc-p-md-1", "md_kv_imported", import_ms=4.0) + "\n"
    )
    (tmp_path / "notes.txt").write_text(line("n16r0-grpc-p-md-0", "prefilled", prefill_ms=1.0))
    hops = logged_hops(tmp_path, ["n16r0-grpc-p-md-0", "n16r0-grpc-p-md-1"])
    assert hops == {
        "prefill": pytest.approx(320.0),
        "push_queued": pytest.approx(5.0),
        "push": pytest.approx(20.0),  # the malformed elapsed_ms is skipped, not zero
        "import": pytest.approx(4.0),
    }
    assert logged_hops(tmp_path, ["unknown"]) == dict.fromkeys(hops)


def test_the_budget_is_what_the_target_round_leaves_each_decode_token():
    def summary(tok_s, ttft, handoff, decode, tail, **extra):
        return {
            "median_tok_s": tok_s,
            "ttft_p50_ms": ttft,
            "handoff_p50_ms": handoff,
            "decode_p50_ms": decode,
            "tail_p50_ms": tail,
            **extra,
        }

    results = {
        2: {
            "grpc-p-md": summary(16.0, 100.0, 50.0, 90.0, 10.0, logged_hops={"push": 12.5}),
            "engine": summary(25.0, 90.0, 10.0, 70.0, 0.0),
            "vllm": summary(20.0, 95.0, 12.0, 80.0, 0.2),
        }
    }
    lines = budget_table(results, output_len=10)
    # 2 requests x 10 tokens at 1.2 x 20 tok/s: a round of 833 ms
    assert "a round of 833 ms" in lines[2]
    stack = next(x for x in lines if "grpc-p-md" in x)
    # its round: 2 x 10 / 16 tok/s = 1250 ms; budget: (833.3 - 100 - 50 - 10) / 8 = 84.2 ms
    assert stack.split()[:7] == ["grpc-p-md", "1250", "100.0", "50.0", "90.0", "10.0", "84.2"]
    assert stack.endswith("push=12.5")
    assert budget_table({2: {"engine": results[2]["engine"]}}, output_len=10) == []
