"""Benchmark metrics: pure math from per-request records to one RESULT dict.

Names follow vLLM's ``bench serve``: TTFT, TPOT (per request, (E2EL − TTFT) /
(tokens − 1)), ITL (every inter-message gap, pooled over requests), E2EL, each as
``{mean, p50, p90, p99}`` with numpy's linear-interpolation percentiles; goodput
is the number of requests meeting *every* SLO of the spec divided by the run's
duration. PDD adds: pipeline counts, the RLD token share Σrld / Σ(rld + md), WAN
KV bytes, the handoff gap (ITL at the RLD→MD handoff) ``{p50, p99}``, and the handoff window
(the longest ITL within 8 tokens of it, ``RequestResult.handoff_window_ms``) ``{p50, p99}``. Errors
count in ``requests`` and ``errors`` but in no latency figure.

TTFDT (``ttfdt_ms``) is the time to the first token a decode stage produced
(``RequestResult.ttfdt_ms``): prefill streams output 0 at once, so TTFT proper
measures prefill alone, while TTFDT includes the KV's trip to the decoder — the
report's TTFT. ``cpu`` is what ``cpu.CpuMeter`` measured (empty when unmeasured).

RESULT keys, exactly: mode, requests, errors, duration_s, ttft_ms, ttfdt_ms,
tpot_ms, itl_ms, e2el_ms, goodput_rps, slo, rld_token_share, pipelines,
wan_bytes, handoff_gap_ms, handoff_window_ms, link, outputs, cpu. A summary of no values is all
``None``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from pdd.bench.record import RequestResult

SLO_METRICS = ("ttft_ms", "ttfdt_ms", "tpot_ms", "e2el_ms")
RESULT_KEYS = (
    "mode",
    "requests",
    "errors",
    "duration_s",
    "ttft_ms",
    "ttfdt_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "goodput_rps",
    "slo",
    "rld_token_share",
    "pipelines",
    "wan_bytes",
    "handoff_gap_ms",
    "handoff_window_ms",
    "link",
    "outputs",
    "cpu",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q, method="linear"))


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = [float(v) for v in values if v is not None]
    mean = float(np.mean(vals)) if vals else None
    return {
        "mean": mean,
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
    }


def parse_slo(spec: str | Mapping[str, float] | None) -> dict[str, float]:
    """``"ttft_ms:10000,tpot_ms:200"`` → ``{"ttft_ms": 10000.0, "tpot_ms": 200.0}``."""
    if spec is None or spec == "":
        return {}
    items = (
        spec.items()
        if isinstance(spec, Mapping)
        else (
            part.split(":", 1) if ":" in part else (part, "")
            for part in spec.split(",")
            if part.strip()
        )
    )
    out: dict[str, float] = {}
    for key, value in items:
        key = str(key).strip()
        if key not in SLO_METRICS:
            raise ValueError(f"slo: unknown metric {key!r}; expected one of {SLO_METRICS}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"slo: {key} needs a number, got {value!r}") from None
        if limit <= 0:
            raise ValueError(f"slo: {key} must be > 0, got {limit}")
        out[key] = limit
    return out


def meets_slo(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """A failed request never meets; a single-token request has no TPOT (nor TTFDT) and meets any bound on it."""
    if not r.ok:
        return False
    for key, limit in slo.items():
        value = getattr(r, key)
        if key in ("tpot_ms", "ttfdt_ms") and value is None:
            continue
        if value is None or value > limit:
            return False
    return True


def goodput_rps(
    records: Sequence[RequestResult], slo: Mapping[str, float], duration_s: float
) -> float | None:
    if duration_s < 0:
        raise ValueError(f"duration_s: must be >= 0, got {duration_s}")
    if duration_s == 0:
        return None
    return sum(meets_slo(r, slo) for r in records) / duration_s


def rld_token_share(records: Sequence[RequestResult]) -> float | None:
    rld = sum(r.rld_tokens for r in records if r.ok)
    md = sum(r.md_tokens for r in records if r.ok)
    return rld / (rld + md) if rld + md else None


def pipeline_counts(records: Sequence[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r.ok and r.pipeline:
            counts[r.pipeline] = counts.get(r.pipeline, 0) + 1
    return dict(sorted(counts.items()))


def handoff_gap_ms(records: Sequence[RequestResult]) -> dict[str, float | None]:
    gaps = [r.handoff_gap_ms for r in records if r.ok and r.handoff_gap_ms is not None]
    return {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)}


def handoff_window_ms(records: Sequence[RequestResult]) -> dict[str, float | None]:
    worst = [w for r in records if r.ok and (w := r.handoff_window_ms) is not None]
    return {"p50": percentile(worst, 50), "p99": percentile(worst, 99)}


def build_result(
    mode: str,
    records: Sequence[RequestResult],
    duration_s: float,
    slo: str | Mapping[str, float] | None = None,
    link: Mapping | None = None,
    cpu: Mapping | None = None,
) -> dict:
    """Everything one run measured, as one JSON-ready dict (keys: ``RESULT_KEYS``)."""
    slo_map = parse_slo(slo)
    ok = [r for r in records if r.ok]
    result = {
        "mode": mode,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": float(duration_s),
        "ttft_ms": summarize(r.ttft_ms for r in ok),
        "ttfdt_ms": summarize(r.ttfdt_ms for r in ok),
        "tpot_ms": summarize(r.tpot_ms for r in ok),
        "itl_ms": summarize(x for r in ok for x in r.itl_ms),
        "e2el_ms": summarize(r.e2el_ms for r in ok),
        "goodput_rps": goodput_rps(records, slo_map, duration_s),
        "slo": slo_map,
        "rld_token_share": rld_token_share(records),
        "pipelines": pipeline_counts(records),
        "wan_bytes": int(sum(r.wan_bytes for r in ok)),
        "handoff_gap_ms": handoff_gap_ms(records),
        "handoff_window_ms": handoff_window_ms(records),
        "link": dict(link or {}),
        "outputs": {r.request_id: list(r.output_token_ids) for r in ok},
        "cpu": dict(cpu or {}),
    }
    # NOTE: the key set is a contract with report.py and users (tests pin it to RESULT_KEYS).
    return result


def write_result(result: Mapping, path: str | Path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


# Keys added after RESULT files were first written: an older file reads with them empty.
_LATER_KEYS = {"handoff_window_ms": {"p50": None, "p99": None}}


def read_result(path: str | Path) -> dict:
    with open(path) as f:
        try:
            result = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a RESULT file (line {e.lineno}: {e.msg})") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a RESULT file (a JSON {type(result).__name__})")
    for key, empty in _LATER_KEYS.items():
        result.setdefault(key, dict(empty))
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"{path}: not a RESULT file, missing {missing}")
    return result
