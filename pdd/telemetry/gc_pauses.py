"""Garbage-collector pauses: keep them off the request path, and measure what is left.

After start-up a service process holds ~350K long-lived Python objects (torch,
transformers, grpc, the model's modules). CPython's full collection scans every
one of them — ~100 ms here, 150 ms on a busy core — and stalls every request in
the process meanwhile: the benchmark saw it as a 150 ms hole between prefill
finishing a prompt and its first token leaving. ``freeze_startup_objects``
moves whatever is alive once the service has started into the permanent
generation (``gc.freeze``, as vLLM and SGLang do after loading the model), so a
collection scans only what requests allocated since. ``watch`` reports every
collection's pause as ``pdd_gc_pause_seconds`` (by generation).
"""

from __future__ import annotations

import gc
import time

from pdd.telemetry import metrics

_started: float | None = None


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def watch() -> None:
    """Observe every collection's pause in ``pdd_gc_pause_seconds`` (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _on_gc(phase: str, info: dict) -> None:
    # NOTE: collections never overlap (they hold the GIL), so one start time is enough.
    global _started
    if phase == "start":
        _started = time.perf_counter()
    elif _started is not None:
        metrics.GC_PAUSE.labels(str(info["generation"])).observe(time.perf_counter() - _started)
        _started = None
