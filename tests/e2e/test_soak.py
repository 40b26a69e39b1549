"""``pdd bench soak``'s short form, end to end: the same checks as ``make soak``'s 20 minutes.

Runs the real command (its own stack, sessions, 10 % of requests cancelled mid-stream, the relay
restarted at half time) for half a minute. Every check must pass — no error but the cancellations,
descriptors and asyncio tasks flat, no request, KV or fast-link region held afterwards — except
that resident memory may grow by 30 % instead of 5 %: in 30 s the processes are still warming up
(allocator arenas, the radix caches filling), which the full soak's 3-minute warm-up leaves out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PDD = Path(sys.executable).with_name("pdd")


@pytest.mark.slow
def test_short_soak_has_no_errors_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [str(PDD), "bench", "soak", "--duration-s", "30", "--warmup-s", "8", "--sample-s", "2"]
        + ["--capacity-s", "6", "--rss-growth", "0.3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((out / "soak.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"errors", "rss_flat", "fds_flat", "tasks_flat", "nothing_held"}
    for name, check in checks.items():
        assert check["ok"], (name, check["detail"], proc.stderr[-2000:])
    outcomes = report["outcomes"]
    assert outcomes.get("completed", 0) > 20 and outcomes.get("cancelled", 0) > 0, outcomes
    assert set(outcomes) <= {"completed", "cancelled"}, outcomes
    assert report["restarts_s"] and "relay-0" in report["back_s"]
    # Every service was sampled, before the load (t < 0) and during it, with its leak gauges.
    names = {s["process"] for s in report["samples"]}
    assert {"gateway", "kvstore", "prefill-0", "relay-0", "main_decode-0"} <= names
    assert any(s["t_s"] < 0 for s in report["samples"])
    assert all(
        "pdd_asyncio_tasks" in s["gauges"] for s in report["samples"] if s["process"] == "gateway"
    )
    assert (out / "soak.svg").read_text().startswith("<svg")
    assert proc.returncode == 0, proc.stderr[-2000:]
