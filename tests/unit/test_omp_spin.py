"""``import pdd`` gives OpenMP workers a short spin before they sleep, unless the operator chose.

Checked where it acts: libgomp's own account of its settings (``OMP_DISPLAY_ENV``), printed when
torch loads it in a fresh interpreter that imported ``pdd`` first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pdd

PROBE = "import os, pdd, torch; torch.ones(1); print(pdd.OMP_SPIN_SET_HERE)"


def _libgomp_sees(**env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    shown = [line.strip() for line in out.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]
    assert shown, out.stderr  # NOTE: libgomp printed its settings: torch runs on libgomp here
    return shown[0], out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "spin", "ours"),
    [
        ({}, pdd.SPIN_COUNT, "True"),
        ({"GOMP_SPINCOUNT": "30000"}, "30000", "False"),  # a spin of the operator's own length
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "0", "False"),  # the operator's policy: libgomp's spin
    ],
)
def test_a_short_spin_unless_the_operator_chose(env, spin, ours):
    assert _libgomp_sees(**env) == (f"GOMP_SPINCOUNT = '{spin}'", ours)
