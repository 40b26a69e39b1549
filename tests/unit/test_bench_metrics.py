"""The metrics math on synthetic timings, against hand-computed values."""

from __future__ import annotations

import json

import pytest

from pdd.bench.metrics import (
    RESULT_KEYS,
    build_result,
    goodput_rps,
    handoff_gap_ms,
    handoff_window_ms,
    parse_slo,
    percentile,
    pipeline_counts,
    read_result,
    rld_token_share,
    summarize,
    write_result,
)
from pdd.bench.record import RequestResult, read_records, records_path, write_records


def rec(rid, ttft, tpot=None, e2el=1000.0, **kw) -> RequestResult:
    return RequestResult(request_id=rid, ttft_ms=ttft, tpot_ms=tpot, e2el_ms=e2el, **kw)


RECORDS = [
    rec(
        "a",
        100.0,
        10.0,
        500.0,
        itl_ms=[10.0, 10.0],
        pipeline="p-md",
        md_tokens=30,
        wan_bytes=100,
        output_token_ids=[1, 2, 3],
    ),
    rec(
        "b",
        200.0,
        20.0,
        800.0,
        itl_ms=[30.0],
        pipeline="p-rld-md",
        rld_tokens=10,
        md_tokens=50,
        handoff_gap_ms=40.0,
        wan_bytes=1000,
        output_token_ids=[4, 5],
    ),
    rec(
        "c",
        300.0,
        50.0,
        2000.0,
        itl_ms=[50.0],
        pipeline="p-rld-md",
        rld_tokens=6,
        md_tokens=4,
        handoff_gap_ms=80.0,
        wan_bytes=10,
        output_token_ids=[6],
    ),
    rec(
        "d", 400.0, None, 400.0, pipeline="p-md", md_tokens=1, output_token_ids=[7]
    ),  # one token: no TPOT
    RequestResult(
        request_id="e",
        pipeline="p-md",
        rld_tokens=99,
        md_tokens=99,
        wan_bytes=5,
        error_code="UNAVAILABLE",
        error_message="down",
    ),
]


def test_percentiles_interpolate_linearly():
    v = [4.0, 1.0, 3.0, 2.0]
    # rank = q/100 · (n − 1) over the sorted values [1, 2, 3, 4]
    assert percentile(v, 50) == pytest.approx(2.5)
    assert percentile(v, 90) == pytest.approx(3.7)
    assert percentile(v, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    with pytest.raises(ValueError, match="q"):
        percentile(v, 101)
    assert summarize([1.0, None, 3.0]) == {
        "mean": 2.0,
        "p50": 2.0,
        "p90": pytest.approx(2.8),
        "p99": pytest.approx(2.98),
    }
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_slo_spec_parsing():
    assert parse_slo("ttft_ms:10000,tpot_ms:200") == {"ttft_ms": 10000.0, "tpot_ms": 200.0}
    assert parse_slo("") == {} and parse_slo({"e2el_ms": 5}) == {"e2el_ms": 5.0}
    for bad, match in (
        ("ttft:5", "unknown metric"),
        ("ttft_ms:x", "number"),
        ("ttft_ms:0", "> 0"),
        ("ttft_ms", "number"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_slo():
    # ttft ≤ 250 and tpot ≤ 20: a, b meet; c fails both; d has no TPOT but ttft 400 fails; e failed.
    assert goodput_rps(RECORDS, parse_slo("ttft_ms:250,tpot_ms:20"), 2.0) == pytest.approx(1.0)
    # only TPOT: a, b, and d (single token meets any TPOT bound)
    assert goodput_rps(RECORDS, {"tpot_ms": 20.0}, 3.0) == pytest.approx(1.0)
    assert goodput_rps(RECORDS, {"e2el_ms": 900.0}, 1.0) == pytest.approx(3.0)  # a, b, d
    assert goodput_rps(RECORDS, {}, 4.0) == pytest.approx(1.0)  # every successful request
    assert goodput_rps(RECORDS, {}, 0.0) is None
    with pytest.raises(ValueError, match="duration_s"):
        goodput_rps(RECORDS, {}, -1.0)


def test_rld_share_pipelines_and_handoff_gap():
    assert rld_token_share(RECORDS) == pytest.approx(
        16 / (16 + 85)
    )  # the failed request does not count
    assert rld_token_share(RECORDS[3:4]) == 0.0 and rld_token_share([]) is None
    assert pipeline_counts(RECORDS) == {"p-md": 2, "p-rld-md": 2}
    assert handoff_gap_ms(RECORDS) == {"p50": pytest.approx(60.0), "p99": pytest.approx(79.6)}
    assert handoff_gap_ms(RECORDS[:1]) == {"p50": None, "p99": None}


def _switched(rid: str, gaps: list[float], relay_tokens: int) -> RequestResult:
    """Token 0 from prefill, then relay tokens, then MainDecode's, ``gaps[i]`` ms before token i + 1."""
    times = [100.0]
    for g in gaps:
        times.append(times[-1] + g)
    stages = ["prefill"] + ["relay"] * relay_tokens + ["main_decode"] * (len(gaps) - relay_tokens)
    return RequestResult(
        request_id=rid,
        token_times_ms=times,
        token_stages=stages,
        ttft_ms=100.0,
        output_token_ids=list(range(len(times))),
    )


def test_handoff_window_finds_a_stall_moved_off_the_switch():
    # A stall 3 tokens before the switch (paced relay, late flush) is what the window must see,
    # while the ITL at the switch itself is 0 (the relay's last token and MainDecode's first together).
    paced = _switched(
        "p", [5, 5, 5, 5, 5, 5, 5, 40, 5, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], relay_tokens=10
    )
    assert paced.handoff_window_ms == 40.0
    # Outside the window (here 12 tokens before the switch) does not count.
    far = _switched("f", [60] + [5] * 10 + [9] * 12, relay_tokens=12)
    assert far.handoff_window_ms == 9.0
    assert _switched("n", [5, 5, 5], relay_tokens=3).handoff_window_ms is None  # never switched
    assert handoff_window_ms([paced, far]) == {
        "p50": pytest.approx(24.5),
        "p99": pytest.approx(39.69),
    }
    assert handoff_window_ms(RECORDS) == {"p50": None, "p99": None}


def test_result_has_exactly_the_contract_fields(tmp_path):
    result = build_result("pdd", RECORDS, 2.0, slo="ttft_ms:250", link={"mbps": 100.0})
    assert tuple(result) == RESULT_KEYS
    assert (result["requests"], result["errors"], result["duration_s"]) == (5, 1, 2.0)
    assert result["ttft_ms"] == {
        "mean": 250.0,
        "p50": 250.0,
        "p90": pytest.approx(370.0),
        "p99": pytest.approx(397.0),
    }
    assert result["tpot_ms"]["p50"] == 20.0  # over a, b, c only
    assert result["itl_ms"]["mean"] == pytest.approx(25.0)  # pooled: 10, 10, 30, 50
    assert result["e2el_ms"]["p50"] == pytest.approx(650.0)
    assert result["goodput_rps"] == pytest.approx(1.0)
    assert result["slo"] == {"ttft_ms": 250.0} and result["link"] == {"mbps": 100.0}
    assert result["wan_bytes"] == 1110
    assert result["outputs"] == {"a": [1, 2, 3], "b": [4, 5], "c": [6], "d": [7]}
    write_result(result, tmp_path / "r.json")
    assert read_result(tmp_path / "r.json") == json.loads(json.dumps(result))
    older = {
        k: v for k, v in result.items() if k != "handoff_window_ms"
    }  # written before that key existed
    write_result(older, tmp_path / "old.json")
    assert read_result(tmp_path / "old.json")["handoff_window_ms"] == {"p50": None, "p99": None}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a RESULT"):
        read_result(tmp_path / "bad.json")


def test_records_round_trip(tmp_path):
    path = records_path(tmp_path / "pdd.json")
    assert path.name == "pdd.records.jsonl"
    write_records(RECORDS, path)
    back = read_records(path)
    assert back == RECORDS and not back[-1].ok


def test_ttfdt_is_the_first_decode_stage_token():
    # Prefill's token at 100 ms; the relay's first at 130 ms; main_decode later.
    r = RequestResult(
        request_id="x",
        ttft_ms=100.0,
        token_times_ms=[100.0, 130.0, 150.0, 400.0],
        token_stages=["prefill", "relay", "relay", "main_decode"],
        output_token_ids=[1, 2, 3, 4],
    )
    assert r.ttfdt_ms == 130.0
    # P-MD over a slow link: the first main_decode token waits for the KV.
    md = RequestResult(
        request_id="y",
        ttft_ms=90.0,
        token_times_ms=[90.0, 900.0],
        token_stages=["prefill", "main_decode"],
        output_token_ids=[1, 2],
    )
    assert md.ttfdt_ms == 900.0
    one = RequestResult(
        request_id="z",
        ttft_ms=80.0,
        token_times_ms=[80.0],
        token_stages=["prefill"],
        output_token_ids=[1],
    )
    assert one.ttfdt_ms is None
    result = build_result("pdd", [r, md, one], 1.0, slo="ttfdt_ms:500")
    assert result["ttfdt_ms"]["p50"] == pytest.approx(
        515.0
    )  # of 130 and 900; the single token has none
    # 130 ≤ 500 meets; 900 misses; a single-token request has no TTFDT and meets the bound.
    assert result["goodput_rps"] == pytest.approx(2.0)
