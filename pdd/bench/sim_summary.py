"""One simulated run's numbers, named as the bench names them, and the table that prints runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEVER = 1e9  # seconds


def pct(xs: Sequence[float], scale: float = 1.0) -> dict:
    a = np.asarray([x for x in xs if x is not None], dtype=float) * scale
    if not len(a):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": float(a.mean()),
        **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)},
    }


def itl_p50_ms(decoders: Sequence) -> float | None:
    """The median gap between a stream's consecutive tokens over every decode instance's steps:
    each step that follows a decoding step is one gap for each token it streamed (as the bench's
    ITL counts a gap per token message)."""
    gaps, weights = [], []
    for d in decoders:
        ends, toks = np.asarray(d.step_ends), np.asarray(d.step_tokens)
        if len(ends) < 2:
            continue
        keep = (toks[1:] > 0) & (toks[:-1] > 0)  # NOTE: back to back: the step before decoded too
        gaps.append(np.diff(ends)[keep])
        weights.append(toks[1:][keep])
    if not gaps or not sum(len(g) for g in gaps):
        return None
    g, w = np.concatenate(gaps), np.concatenate(weights)
    order = np.argsort(g)
    cum = np.cumsum(w[order])
    return float(g[order][np.searchsorted(cum, cum[-1] / 2)] * 1e3)


def summarize(run, outcomes: Sequence) -> dict:
    """``run`` is the simulator's ``_Run``; requests arriving before ``warmup_s`` are left out."""
    cfg = run.cfg
    warm = cfg.warmup_s if len(outcomes) > 200 else 0.0
    meas = [o for o in outcomes if o.req.arrival >= warm]
    done = [o for o in meas if o.ttft is not None]
    sent = [o for o in done if o.pipeline != "md" and o.sent_tokens > 0]
    rld = sum(o.rld_tokens for o in done)
    md = sum(o.md_tokens for o in done)
    horizon = max(run.loop.now, 1e-9)
    # NOTE: a request that never got a token counts as never (it fails any SLA).
    ttft = pct([NEVER if o.ttft is None else o.ttft for o in meas])
    span = max(o.req.arrival for o in meas) - min(o.req.arrival for o in meas) if meas else 0.0
    decoders = run.mds + run.relays
    return {
        "mode": run.mode,
        "dist": cfg.dist,
        "rps": cfg.rps,
        "requests": len(meas),
        "unfinished": len(meas) - len(done),
        "served_rps": len(done) / span if span else None,
        "ttft_s": ttft,
        "e2e_s": pct([o.e2e for o in done]),
        "kv_transfer_ms": pct([o.transfer for o in sent], 1000),
        "kv_queue_ms": pct([o.queue for o in sent], 1000),
        "md_hit": float(np.mean([o.hit for o in done])) if done else None,
        "target_hit": float(np.mean([o.req.target_hit for o in meas])) if meas else None,
        "prompt_tokens": float(np.mean([o.req.prompt for o in meas])) if meas else None,
        "wan_gb": run.wan_bytes / 1e9,
        "pool_saturated": float(np.mean([ln.saturated_s for ln in run.links]) / horizon)
        if run.links
        else 0.0,
        "rld_token_share": rld / (rld + md) if rld + md else 0.0,
        "rld_tokens": rld,
        "md_tokens": md,
        "pipelines": {p: sum(o.pipeline == p for o in done) for p in ("md", "p-md", "p-rld-md")},
        "handoffs": {h: sum(o.handoff == h for o in done) for h in ("one-shot", "catch-up")},
        "handoff_gap_ms": pct([o.gap for o in done], 1000),
        "itl_ms_p50": itl_p50_ms(decoders),
        "busy": {
            "prefill": sum(p.busy_s for p in run.prefill) / horizon / max(1, len(run.prefill)),
            "main_decode": sum(m.busy_s for m in run.mds) / horizon / max(1, len(run.mds)),
            "relay": sum(r.busy_s for r in run.relays) / horizon / max(1, len(run.relays)),
        },
        "drc_evictions": sum(d.cache.evicted for d in decoders),
        "sla_met": bool(
            len(done) == len(meas)
            and ttft["p90"] is not None
            and ttft["p90"] < cfg.sla_p90_s
            and ttft["p99"] < cfg.sla_p99_s
        ),
    }


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(runs: Sequence[dict]) -> str:
    head = (
        f"{'mode':<7} {'dist':<8} {'TTFT p50/p90/p99 s':>19} {'KV xfer p50/p99 ms':>19} "
        f"{'queue ms':>8} {'MD hit':>6} {'RLD':>6} {'MD/P-MD/RLD':>14} {'gap p99':>7} SLA"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        t, x, p = r["ttft_s"], r["kv_transfer_ms"], r["pipelines"]
        lines.append(
            f"{r['mode']:<7} {r['dist']:<8} "
            f"{fmt(t['p50']) + '/' + fmt(t['p90']) + '/' + fmt(t['p99']):>19} "
            f"{fmt(x['p50'], 0) + '/' + fmt(x['p99'], 0):>19} {fmt(r['kv_queue_ms']['mean'], 0):>8} "
            f"{fmt(r['md_hit'], 3):>6} {r['rld_token_share']:>6.1%} "
            f"{p['md']}/{p['p-md']}/{p['p-rld-md']:>4} "
            f"{fmt(r['handoff_gap_ms']['p99'], 0):>7} {'yes' if r['sla_met'] else 'no'}"
        )
    return "\n".join(lines)
