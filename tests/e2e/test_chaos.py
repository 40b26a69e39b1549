"""``pdd chaos`` end to end, with one fault: a MainDecode SIGKILLed while requests stream.

Runs the real command (its own supervised stack, two MainDecodes behind delayed WAN links): every
request must complete, with no token lost or repeated, each output equal to the fault-free run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PDD = Path(sys.executable).with_name("pdd")


@pytest.mark.slow
def test_pdd_chaos_survives_a_killed_main_decode(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run(
        [str(PDD), "chaos", "--faults", "main_decode", "--requests", "6", "--in-flight", "3"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((out / "chaos.json").read_text())
    (row,) = report["rows"]
    assert row["fault"] == "main_decode" and row["injected"], proc.stdout
    assert row["in_flight"] >= 3
    assert row["completed"] == row["requests"] == 6, row
    assert row["lost"] == row["duplicated"] == row["changed"] == 0, row
    assert row["identical_greedy"] == row["greedy"] == 3, row
    assert row["identical_seeded"] == row["seeded"] == 3, row
    assert row["requests_holding_kv"] == 0, row
    assert row["recover_s"] is not None
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| main_decode | p-md |" in (out / "chaos.md").read_text()
    gateway_log = (out / "logs" / "gateway.log").read_text()
    assert "main_decode_lost" in gateway_log  # the kill landed mid-request: a migration ran
