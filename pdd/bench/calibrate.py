"""The testbed's yardsticks: KV bytes per token and the idle decode step.

The comparison is only meaningful in dimensionless units — a WAN transfer "lasts
N decode steps" — so the demo measures the step on this machine, in process,
before any stack runs (the idle, uncontended figure), and reads the KV size off
the model config. ``transfer_steps`` then puts the requests' measured WAN
transfers in step units, split at the router's hit threshold.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np

from pdd.bench.record import RequestResult

FP32_BYTES = 4


def kv_bytes_per_token(model: str) -> int:
    """Bytes of fp32 KV one token occupies: 2 (K, V) × layers × KV heads × head dim × 4."""
    from pdd.serving.model_spec import load_model  # NOTE: lazy: loads torch

    c = load_model(model).config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * FP32_BYTES


def idle_step_ms(
    model: str,
    *,
    threads: int = 1,
    block_size: int = 16,
    prompt_tokens: int = 1024,
    new_tokens: int = 32,
    repeats: int = 3,
) -> float:
    """One batch-1 decode step of ``model`` on an idle machine (best of ``repeats``), prefill excluded."""
    import torch

    from pdd.engine import Engine, EngineConfig, SamplingParams
    from pdd.serving.model_spec import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ckpt = load_model(model)
        engine = Engine(ckpt, EngineConfig(block_size=block_size, kv_cache_bytes=64 * 2**20))
        rng = random.Random(0)
        vocab = ckpt.config.vocab_size
        best = float("inf")
        for _ in range(repeats):
            prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
            t0 = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            t1 = time.perf_counter()
            prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
            engine.generate([prompt], SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
            t2 = time.perf_counter()
            best = min(best, ((t2 - t1) - (t1 - t0)) / new_tokens * 1000.0)
        return max(best, 1e-3)
    finally:
        torch.set_num_threads(before)


def link_ms(wan_bytes: float, mbps: float) -> float:
    """How long ``wan_bytes`` occupy a link of ``mbps`` alone (serialization time, no sharing)."""
    if mbps <= 0:
        raise ValueError(f"mbps: must be > 0, got {mbps}")
    return wan_bytes * 8 / (mbps * 1e3)


def transfer_steps(
    records: Sequence[RequestResult],
    step_ms: float,
    threshold: float = 0.95,
    mbps: float | None = None,
) -> dict:
    """WAN transfers in decode steps, P50 and max, for requests below and at/above ``threshold`` MD hit.

    With ``mbps``: the link time of each request's delta (bytes ÷ bandwidth); without:
    the push time prefill measured, which also holds prefill computing the chunks it
    streams and the link's sharing with other pushes.
    """
    if step_ms <= 0:
        raise ValueError(f"step_ms: must be > 0, got {step_ms}")
    out: dict = {}
    for name, keep in (
        ("low_hit", lambda h: h < threshold),
        ("high_hit", lambda h: h >= threshold),
    ):
        chosen = [
            r
            for r in records
            if r.ok and r.actual_hit is not None and keep(r.actual_hit) and r.wan_bytes
        ]
        steps = [
            (link_ms(r.wan_bytes, mbps) if mbps else r.wan_transfer_ms) / step_ms for r in chosen
        ]
        out[name] = {
            "requests": len(steps),
            "p50": float(np.median(steps)) if steps else None,
            "max": float(max(steps)) if steps else None,
        }
    return out
