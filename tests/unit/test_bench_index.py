"""``pdd bench index``: every mode runs against a real Redis (gRPC: kvstore as its own process),
all agree on every call, the table names each instance count and mode, and the store calls say
where their time went (a small run; the real one is 64K tokens, 8/64)."""

from __future__ import annotations

import json

from pdd.cli import main as pdd_main


def _run(redis_url, tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "rows.json"
    argv = ["bench", "index", "--redis-url", redis_url, "--prompt-tokens", "2048"]
    argv += ["--iterations", "12", "--reference-iterations", "6", "--json", str(out), *extra]
    assert pdd_main(argv) == 0
    return json.loads(out.read_text())


def test_bench_index_reports_every_mode_side_by_side_and_the_breakdown(redis_url, tmp_path, capsys):
    rows = _run(redis_url, tmp_path, "--instances", "2,5")
    assert [(r["instances"], r["mode"], r["calls"]) for r in rows] == [
        (n, mode, 6 if mode == "reference" else 12)
        for n in (2, 5)
        for mode in ("reference", "store", "proto", "grpc")
    ]
    assert all(0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] for r in rows)
    for r in (r for r in rows if r["mode"] == "store"):
        assert r["hashing_ms"] > 0 and r["index_ms"] > r["in_redis_ms"] > 0, r
        # The view held (nobody registered meanwhile): one Lua call a prediction, no listing.
        assert (r["refreshes"], r["registry_ms"], r["script_calls_per_call"]) == (0, 0, 1), r
        assert r["guessed_share"] > 0.3, r  # the same prompts again: remembered runs
    out = capsys.readouterr().out
    assert "2048-token prompt, block 16 (128 chained hashes)" in out
    assert "load average" in out and "in_redis" in out


def test_bench_index_without_guesses_searches_from_the_ends(redis_url, tmp_path):
    rows = _run(redis_url, tmp_path, "--instances", "3", "--no-guesses")
    assert [r["mode"] for r in rows] == ["reference", "store", "proto"]  # kvstore always guesses
    assert [r["guessed_share"] for r in rows if r["mode"] == "store"] == [0]
