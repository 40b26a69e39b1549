"""``import pdd`` makes OpenMP workers sleep when idle, unless the operator chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, pdd; print(os.environ.get('OMP_WAIT_POLICY'), pdd.OMP_WAIT_POLICY_SET_HERE)"


def _policy(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "seen"),
    [
        ({}, "PASSIVE True"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE False"),
        ({"GOMP_SPINCOUNT": "30000"}, "None False"),  # a spin of the operator's own length
    ],
)
def test_passive_unless_the_operator_set_a_policy_or_a_spin(env, seen):
    assert _policy(**env) == seen
