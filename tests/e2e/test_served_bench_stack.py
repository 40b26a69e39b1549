"""``pdd bench served`` against a real stack (every service its own process), without vLLM.

A few requests at concurrency 1 and 2 through both of the gateway's doors and both pipelines,
and our engine in-process: every contender must serve every token, greedy outputs identical to
the in-process engine's (the design's equivalence of pipelines), and the CPU accounting must
have read the services it charges. Stack B (``--b-env``) serves P-MD beside stack A: a second
stack of its own processes, with the environment it was given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.bench import served
from pdd.engine import tiny_model

pytestmark = pytest.mark.slow


def test_served_bench_smoke(tmp_path, capsys):
    model = tiny_model(7, std=0.05).save_hf(tmp_path / "model")
    out = tmp_path / "served.json"
    code = served.main(
        [
            "--model",
            str(model),
            "--contenders",
            "grpc-p-md,http-p-md,grpc-p-rld-md,engine,grpc-p-md@b",
            "--b-env",
            "PDD_LOG_LEVEL=debug",
            "--concurrency",
            "1,2",
            "--rounds",
            "1",
            "--prompt-len",
            "24",
            "--output-len",
            "8",
            "--threads",
            "1",
            "--quiet-max-wait",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"1", "2"}
    # NOTE: /proc counts CPU in 10 ms ticks: a round of one tiny request may not reach one in a
    # process, so each stack process is accounted in every round and used CPU over the run.
    used = dict.fromkeys(("main_decode-0", "gateway", "prefill-0"), 0.0)
    for conc, by_name in report["results"].items():
        assert set(by_name) == {"grpc-p-md", "http-p-md", "grpc-p-rld-md", "engine", "grpc-p-md@b"}
        for name, s in by_name.items():
            assert s["errors"] == 0, (conc, name)
            assert s["median_tok_s"] > 0 and s["ttft_p50_ms"] > 0 and s["tpot_p50_ms"] > 0
            assert s["same_outputs_as"] == f"engine {conc}/{conc}", (conc, name)
        for c in by_name.keys() - {"engine"}:
            for process in used:
                used[process] += by_name[c]["cpu_ms_per_token"][process]
    assert all(ms > 0 for ms in used.values()), used
    assert {r["contender"] for r in report["rounds"]} == {
        "grpc-p-md",
        "http-p-md",
        "grpc-p-rld-md",
        "engine",
        "grpc-p-md@b",
    }
    # Stack B is its own processes: charged apart from A's, and started with its environment.
    b_pids = report["results"]["2"]["grpc-p-md@b"]["cpu_ms_per_token"]
    assert {"main_decode-0", "prefill-0", "gateway"} <= b_pids.keys()
    printed = capsys.readouterr().out
    assert "x vLLM" in printed and "grpc-p-rld-md" in printed
    assert "stack B (PDD_LOG_LEVEL=debug) against stack A" in printed
    work = Path(next(w for w in printed.split() if w.startswith("/") and "pdd_served_" in w))
    # NOTE: kvstore logs each call without a request id (registrations, heartbeats) at debug.
    logs_a, logs_b = ((work / d / "kvstore.log").read_text() for d in ("logs", "logs-b"))
    assert '"level": "debug"' in logs_b and '"level": "debug"' not in logs_a
