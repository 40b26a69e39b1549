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
from collections.abc import Mapping, Sequence

import numpy as np

from pdd.bench.record import RequestResult

FP32_BYTES = 4
# The profile's per-request stack costs and the bench mode that measures each.
OVERHEADS = {"request_overhead_ms": "idc-pd", "md_request_overhead_ms": "pdd"}
# The stack's cost per decode step of each stage (``calibrate_stack.measure_stream``).
STREAM = ("md_stream_ms_per_step", "relay_stream_ms_per_step", "prefill_stack_factor")
# (measure_stream the first two, measure_prefill the factor)
NOT_MEASURED = "not measured (`pdd bench calibrate --stack` measures it)"
# What each stack number is while not measured: no cost, and a prefill as fast as the engine's.
UNMEASURED = {**dict.fromkeys((*OVERHEADS, *STREAM), 0.0), "prefill_stack_factor": 1.0}


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


# --- `pdd bench calibrate`: this machine's engine and link as a simulator profile -------------------


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _fit(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares ``ys ≈ rows @ coef``, every coefficient clipped at 0 (a cost is never negative)."""
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(ys, float), rcond=None)
    return [max(0.0, float(c)) for c in coef]


def fit_prefill(
    whole: Mapping[int, float], after: Mapping[tuple[int, int], float]
) -> tuple[float, float, float]:
    """(overhead ms, tokens/s, attention tokens) of the simulator's prefill model
    (``ChipProfile.prefill_ms``: o + k/rate × (1 + (c + k/2)/A)) from prefill ms of ``whole``
    prompts by length and of k tokens ``after`` c cached ones, by (c, k)."""
    rows = [(1, n, n * n / 2) for n in whole] + [(1, k, k * c + k * k / 2) for c, k in after]
    o, a, b = _fit(rows, [*whole.values(), *after.values()])
    return o, 1e3 / max(a, 1e-6), a / b if b > 0 else 1e9


def _decode_step_ms(engine, prompts: list[list[int]], steps: int) -> float:
    """The median time of one decode step with ``prompts`` all decoding (prefill excluded)."""
    from pdd.engine import SamplingParams

    sp = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    rids = [f"calibrate-{len(p)}-{i}-{time.monotonic_ns()}" for i, p in enumerate(prompts)]
    for rid, prompt in zip(rids, prompts):
        engine.add_request(rid, prompt, sp)
    for _ in range(sum(map(len, prompts)) + 1):  # NOTE: a bound: each step computes >= 1 token
        if len(engine.last_batch) == len(rids) and all(n == 1 for _, n in engine.last_batch):
            break
        engine.step()  # prefill, until one step decodes every prompt
    else:
        raise RuntimeError(f"calibrate: {len(rids)} prompts never decoded in one step together")
    times = [_timed(engine.step) for _ in range(steps)]
    while engine.has_unfinished():
        engine.step()  # NOTE: a finished request leaves the engine (and frees its KV) by itself
    return float(np.median(times))


def fit_extend(slopes: dict[int, float]) -> tuple[float, float]:
    """Per-token extend cost at no prefix and the prefix at which it doubles, from the slopes
    (ms a token) measured after two prefix lengths: slope(c) = a · (1 + c / attention). A slope
    that does not grow (noise) gives (the smaller slope, 0: no attention term)."""
    (c1, s1), (c2, s2) = sorted(slopes.items())
    if s2 <= s1 or s1 <= 0:
        return max(min(s1, s2), 0.0), 0.0
    growth = (s2 - s1) / (c2 - c1)  # ms a token, per token of prefix
    a = s1 - c1 * growth
    if a <= 0:  # NOTE: steeper than linear from zero: keep the measured slope, no growth term
        return s1, 0.0
    return a, a / growth


def measure_engine(
    model: str, *, threads: int = 1, kv_cache_mb: int = 256, quick: bool = False
) -> dict:
    """Prefill ms by length, decode step ms by batch and context, extend ms by k: fitted to the
    simulator's chip model (``sim_profile.ChipProfile``); each number says how it was measured."""
    import torch

    from pdd.engine import Engine, EngineConfig, SamplingParams
    from pdd.serving.model_spec import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ckpt = load_model(model)
        cfg = EngineConfig(kv_cache_bytes=kv_cache_mb * 2**20)
        engine = Engine(ckpt, cfg)
        rng = random.Random(0)
        vocab = ckpt.config.vocab_size
        ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.generate([ids(64)], one)  # warm-up: a fresh process's first passes are slow
        # Prefill: whole prompts of n tokens, best of 2; and k new tokens after c cached ones —
        # a served prefill's usual case, and what tells the attention term (k·c) from the
        # per-token one (whole prompts alone leave them nearly collinear).
        lengths = (128, 512, 1024) if quick else (128, 256, 512, 1024, 2048)
        pre = {
            n: min(_timed(lambda n=n: engine.generate([ids(n)], one)) for _ in range(2))
            for n in lengths
        }
        suffixes = ((1024, 32), (1024, 256)) if quick else ((1024, 32), (1024, 256), (2048, 64))

        def after_cached(c: int, k: int) -> float:
            base = ids(c)
            engine.generate([base], one)  # cached now
            return _timed(lambda: engine.generate([base + ids(k)], one))

        after = {(c, k): min(after_cached(c, k) for _ in range(2)) for c, k in suffixes}
        o, rate, attention = fit_prefill(pre, after)
        # Decode: B prompts of c tokens; once every one decodes, each step timed alone (median).
        # NOTE: not a whole generate less a prefill-only one: on a busy host the two prefills'
        # jitter is larger than the few ms of steps between them.
        steps = 8 if quick else 16
        rows, ys = [], []
        for batch in (1, 4) if quick else (1, 2, 4, 8):
            for ctx in (256, 1024):
                rows.append((1, batch, batch * ctx / 1e6))
                ys.append(_decode_step_ms(engine, [ids(ctx) for _ in range(batch)], steps))
        s0, s1, s2 = _fit(rows, ys)
        # Extend by k: k new tokens after a cached prefix (one chunk), at two prefix lengths:
        # the slope over k at each, and how it grows with the prefix (attention) between them.
        ks, prefixes = (8, 32, 128), (512, 2048)
        ext = {}
        for c in prefixes:
            for k in ks:
                base = ids(c)
                engine.generate([base], one)  # cached now
                ext[c, k] = _timed(lambda b=base, k=k: engine.generate([b + ids(k)], one))
        per_k, ext_attention = fit_extend(
            {c: _fit([(1, k) for k in ks], [ext[c, k] for k in ks])[1] for c in prefixes}
        )
        kv_tokens = kv_cache_mb * 2**20 // kv_bytes_per_token(model)
    finally:
        torch.set_num_threads(before)
    how = f"measured by `pdd bench calibrate` on {model}, {threads} thread(s), {time.strftime('%Y-%m-%d')}"
    return {
        "prefill_tokens_per_s": (
            rate,
            f"{how}: prefill ms at {list(lengths)} tokens = "
            f"{[round(pre[n], 2) for n in lengths]} and of k after c cached (c, k) "
            f"{list(after)} = {[round(t, 2) for t in after.values()]}, fitted "
            "o + k/rate + (k·c + k²/2)·b",
        ),
        "prefill_overhead_ms": (o, f"{how}: the fit's constant"),
        "prefill_attention_tokens": (
            attention,
            f"{how}: the fit's linear ÷ quadratic term",
        ),
        "prefill_chunk_tokens": (2048, "pdd/engine/config.py: max_num_batched_tokens (prefill's)"),
        "decode_step_ms": (
            s0,
            f"{how}: step ms (median of {steps} steps each) {[round(y, 3) for y in ys]} at "
            f"(batch, ctx) {[(r[1], int(r[2] * 1e6 / r[1])) for r in rows]}, least squares",
        ),
        "decode_ms_per_seq": (s1, f"{how}: the fit's batch term"),
        "decode_ms_per_mtok": (s2, f"{how}: the fit's context term"),
        "extend_ms_per_token": (
            per_k,
            f"{how}: {ks} tokens after a cached {prefixes}: "
            f"{[round(t, 2) for t in ext.values()]} ms; the slope over k at each, at no prefix",
        ),
        "extend_attention_tokens": (
            ext_attention,
            f"{how}: the prefix at which that slope doubles (from the two slopes; 0: no growth "
            "measured)",
        ),
        "kv_budget_tokens": (
            int(kv_tokens),
            f"the testbed's --kv-cache-mb {kv_cache_mb} ÷ {kv_bytes_per_token(model)} B a token",
        ),
        "max_batch": (cfg.max_num_seqs, "pdd/engine/config.py: max_num_seqs"),
    }


def write_profile(
    path: str,
    chip: dict,
    *,
    name: str,
    link: dict,
    kv_bytes: int,
    model: str,
    overheads: dict | None = None,
) -> None:
    import json

    def entry(v: tuple) -> dict:
        return {"value": v[0], "source": v[1]}

    chips = {"cpu": {k: entry(v) for k, v in chip.items()}}
    wire = "pdd/serving/prefill.py PrefillConfig.wan_dtype default None: the engine's fp32, uncompressed"
    with open(path, "w") as f:
        json.dump(
            {
                "name": name,
                "kv_bytes_per_token": entry((kv_bytes, f"fp32 KV of {model}")),
                "kv_wire_dtype": entry(("float32", wire)),
                "kv_wire_ratio": entry((1.0, wire)),
                **{
                    k: entry(v)
                    for k, v in (
                        overheads or {k: (v, NOT_MEASURED) for k, v in UNMEASURED.items()}
                    ).items()
                },
                "chips": chips,
                "link": {k: entry(v) for k, v in link.items()},
            },
            f,
            indent=1,
        )
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench calibrate [--model M] [--threads 1] [--quick] [--stack] --out PROFILE.json``."""
    import argparse
    import sys

    from pdd.bench.modes import Testbed

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        argv = argv[1:]
    tb = Testbed()
    p = argparse.ArgumentParser(prog="pdd bench calibrate", description=main.__doc__)
    p.add_argument("--model", default=tb.model)
    p.add_argument("--threads", type=int, default=tb.threads)
    p.add_argument("--kv-cache-mb", type=int, default=tb.kv_cache_mb)
    p.add_argument("--quick", action="store_true", help="fewer points (~15 s)")
    p.add_argument(
        "--stack",
        action="store_true",
        help="also the stack's cost per request, per decode step and per prefill (~1.5 min a repeat)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="with --stack: measure the stack this many times and keep each number's median",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.threads < 1 or a.kv_cache_mb < 1 or a.repeats < 1:
        p.error("--threads, --kv-cache-mb and --repeats: must be >= 1")
    from pathlib import Path

    if not Path(a.out).resolve().parent.is_dir():
        p.error(f"--out: no folder {Path(a.out).resolve().parent}")
    chip = measure_engine(a.model, threads=a.threads, kv_cache_mb=a.kv_cache_mb, quick=a.quick)
    src = "pdd/bench/modes.py Testbed (what the WAN emulator shapes to)"
    link = {
        "wan_gbps": (tb.wan_mbps / 1e3, src),
        "wan_delay_ms": (tb.wan_delay_ms, src),
        "pool_streams": (4, "pdd/serving/prefill.py PrefillConfig.wan_streams default"),
        "fast_gbps": (8.0, "assumed: shared memory on one host (~1 GB/s through Python)"),
    }
    kw = {}
    if a.stack:
        from pdd.bench.calibrate_stack import (
            measure_prefill,
            measure_stack,
            measure_stream,
            median_of,
        )

        runs = []
        for _ in range(a.repeats):
            over = {k: measure_stack(tb, chip, mode) for k, mode in OVERHEADS.items()}
            over.update(measure_stream(tb, chip))
            over["prefill_stack_factor"] = measure_prefill(tb, chip)
            runs.append(over)
        kw["overheads"] = median_of(runs)
    write_profile(
        a.out,
        chip,
        name="testbed",
        link=link,
        kv_bytes=kv_bytes_per_token(a.model),
        model=a.model,
        **kw,
    )
    for k, (v, _) in chip.items():
        print(f"{k:<26} {v:,.4g}")
    for k, (v, _) in kw.get("overheads", {}).items():
        print(f"{k:<26} {v:,.4g}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
