"""``pdd bench index``: both predictors run against a real Redis, agree on every call, and the
table names each instance count and mode (a small run; the real one is 64K tokens, 8/64)."""

from __future__ import annotations

import json

from pdd.cli import main as pdd_main


def test_bench_index_reports_reference_and_binary_search_side_by_side(redis_url, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = pdd_main(
        [
            "bench",
            "index",
            "--redis-url",
            redis_url,
            "--instances",
            "2,5",
            "--prompt-tokens",
            "2048",
            "--iterations",
            "12",
            "--reference-iterations",
            "6",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["instances"], r["mode"], r["calls"]) for r in rows] == [
        (2, "reference", 6),
        (2, "log search", 12),
        (5, "reference", 6),
        (5, "log search", 12),
    ]
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in rows)
    assert "2048-token prompt, block 16 (128 chained hashes)" in capsys.readouterr().out
