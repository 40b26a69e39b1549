"""``pdd bench served``'s ceiling table: the throughput each contender's CPU a token allows here.

However a contender's work is arranged, it serves at most (cores busy) / (CPU a token) tokens a
second. Both are measured in the same rounds as its throughput: the CPU every process it is
charged with spent (the bench's client included: it takes the same cores), and the busy cores
its rounds kept, that CPU over their wall time. Two bounds follow for each contender:

- **at our engine's busy cores**: our engine in-process — one process, nothing between its steps
  — is what keeps this host's cores busiest, so its busy cores stand for what the host gives a
  serving process; a contender's ceiling is its throughput at that utilisation with its own CPU
  a token. ``achieved`` is how much of it the contender reached; the rest is cores left idle or
  steps stretched by another process taking a core mid-step, which arrangement can win back.
- **at every core**: the same with the cores busy all the time, the bound nothing passes.

CPU time counts spin-waits as work: a process that polls while it waits (vLLM's engine core)
shows cores busy that it did not need, so its ceiling can sit below what it served (``achieved``
above 100 %). Our engine's OpenMP workers spin ~25 µs before they sleep, in-process and in the
stack alike.

Either bound divided by vLLM's throughput says whether a target (issue 19: 1.2× vLLM's server)
is within reach of arrangement at all on this host, or needs less CPU a token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdd.bench.served_overhead import ENGINE, REFERENCE, divide


def cpu_totals(cpu_s: Mapping[str, float | None], wall_s: float, tokens: int) -> dict[str, Any]:
    """CPU ms a token over every process a contender is charged with, and the cores it kept
    busy (its CPU seconds over ``wall_s``); both None unless every process's CPU was read —
    a part left out would raise the ceiling — and came to more than nothing (CPU time counts in
    clock ticks, 10 ms here: rounds shorter than a tick can read none)."""
    unknown = {"cpu_ms_per_token_all": None, "busy_cores": None}
    if not cpu_s or any(v is None for v in cpu_s.values()) or tokens <= 0 or wall_s <= 0:
        return unknown
    total = sum(v for v in cpu_s.values() if v is not None)
    if total <= 0:
        return unknown
    return {"cpu_ms_per_token_all": 1000.0 * total / tokens, "busy_cores": total / wall_s}


def ceiling(
    summary: Mapping[str, Any], engine: Mapping[str, Any] | None, cores: int
) -> dict[str, float | None]:
    """One contender's ceilings in tok/s (``at_engine``, ``at_cores``) and the share of the
    first it reached (``achieved``); None where a figure is missing."""
    per_token = summary.get("cpu_ms_per_token_all")
    busy = None if engine is None else engine.get("busy_cores")
    if not per_token:
        return {"at_engine": None, "at_cores": None, "achieved": None}
    at_engine = None if busy is None else 1000.0 * busy / per_token
    tok_s = summary.get("mean_tok_s")
    return {
        "at_engine": at_engine,
        "at_cores": 1000.0 * cores / per_token if cores > 0 else None,
        "achieved": divide(tok_s, at_engine),
    }


def _cell(value: float | None, width: int, spec: str) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def ceiling_table(results: Mapping[int, Mapping[str, Mapping[str, Any]]], cores: int) -> list[str]:
    """The printed lines; none when the run has no ``engine`` contender to take the busy cores
    from. The ``x vLLM`` columns divide by vLLM's mean tok/s in the same run."""
    rows: list[str] = []
    for conc, by_name in results.items():
        engine = by_name.get(ENGINE)
        if engine is None or engine.get("busy_cores") is None:
            continue
        ref = by_name.get(REFERENCE, {}).get("mean_tok_s")
        for name, s in by_name.items():
            c = ceiling(s, engine, cores)
            rows.append(
                f"{conc:>4} {name:<16}{_cell(s.get('cpu_ms_per_token_all'), 11, '.2f')}"
                f"{_cell(s.get('busy_cores'), 8, '.2f')}{_cell(s.get('mean_tok_s'), 9, '.1f')}"
                f"{_cell(c['at_engine'], 13, '.1f')}{_cell(divide(c['at_engine'], ref), 8, '.2f')}"
                f"{_cell(c['achieved'], 10, '.0%')}{_cell(c['at_cores'], 13, '.1f')}"
                f"{_cell(divide(c['at_cores'], ref), 8, '.2f')}"
            )
    if not rows:
        return []
    head = (
        f"{'conc':>4} {'contender':<16}{'CPU ms/tok':>11}{'busy':>8}{'tok/s':>9}"
        f"{'ceiling':>13}{'x vLLM':>8}{'achieved':>10}{'all cores':>13}{'x vLLM':>8}"
    )
    where = f"{cores} cores" if cores > 0 else "this host (its core count unknown)"
    return [
        f"what the CPU a token allows on {where} (every process, the client included; "
        "ceiling: at our engine's busy cores)",
        head,
        *rows,
    ]
