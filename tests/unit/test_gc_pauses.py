"""Start-up objects frozen out of garbage collection, and every collection timed (in a fresh process)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import gc
from prometheus_client import REGISTRY
from pdd.telemetry import gc_pauses

startup = [[i] for i in range(50_000)]  # long-lived, as a service's modules and model are
frozen = gc_pauses.freeze_startup_objects()
assert frozen >= 50_000, frozen
# A later full collection no longer scans them: only what was allocated since is in the generations.
assert sum(gc.get_count()) < 1_000, gc.get_count()
assert len(gc.get_objects()) < frozen, (len(gc.get_objects()), frozen)

gc_pauses.watch()
gc_pauses.watch()
assert gc.callbacks.count(gc_pauses._on_gc) == 1  # idempotent
sample = lambda: REGISTRY.get_sample_value("pdd_gc_pause_seconds_count", {"generation": "2"}) or 0.0
before = sample()
gc.collect()
assert sample() == before + 1, (before, sample())
print("ok")
"""


def test_startup_objects_are_frozen_and_collections_are_timed():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
