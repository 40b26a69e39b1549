"""``pdd bench served``'s overhead table: every contender as a ratio to ``vllm serve``.

The main table gives each contender's own figures; this one answers the issue's question for
PDD on vLLM (``stack-vllm``: the same engine behind PDD's gateway, prefill, WAN link and
MainDecode) in one line per contender: throughput, TTFT, TPOT and CPU per token, each divided
by vLLM's own OpenAI server's in the same run, and where the extra CPU goes (the processes
whose CPU per token is largest). A throughput ratio below 1 and the others above 1 are the
stack's overhead.

``emulator_table`` says how much of that the testbed itself is: the WAN emulator's processes
(``wan-*``) forward every byte between the clusters, which a real WAN costs no process at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REFERENCE = "vllm"
# Figures divided by the reference's: (summary key, column title).
RATIOS = (
    ("median_tok_s", "tok/s"),
    ("ttft_p50_ms", "TTFT"),
    ("tpot_p50_ms", "TPOT"),
    ("cpu_ms_per_token_total", "CPU/tok"),
)


def divide(value: float | None, reference: float | None) -> float | None:
    """``value / reference``; None where either is unknown or the reference is 0."""
    return None if value is None or not reference else value / reference


def overhead(summary: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float | None]:
    """One contender's summary over the reference's, key by key (None where either is unknown)."""
    return {key: divide(summary.get(key), reference.get(key)) for key, _ in RATIOS}


def heaviest(cpu_ms_per_token: Mapping[str, float | None], n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` processes with the most CPU per token, heaviest first (unknowns left out)."""
    known = [(name, v) for name, v in cpu_ms_per_token.items() if v is not None]
    return sorted(known, key=lambda kv: -kv[1])[:n]


def overhead_table(results: Mapping[int, Mapping[str, dict[str, Any]]]) -> list[str]:
    """The printed lines; none at all when the run has no ``vllm`` to divide by."""
    rows = []
    for conc, by_name in results.items():
        ref = by_name.get(REFERENCE)
        if ref is None:
            continue
        for name, s in by_name.items():
            if name == REFERENCE:
                continue
            ratios = overhead(s, ref)
            cells = "".join(
                f"{'-' if ratios[k] is None else f'{ratios[k]:.2f}':>9}" for k, _ in RATIOS
            )
            top = " ".join(f"{p}={v:.2f}" for p, v in heaviest(s["cpu_ms_per_token"]))
            rows.append(f"{conc:>4} {name:<16}{cells}{s.get('same_outputs_as', '-'):>16}  {top}")
    if not rows:
        return []
    head = f"{'conc':>4} {'contender':<16}" + "".join(f"{t:>9}" for _, t in RATIOS)
    head += f"{'same outputs':>16}  heaviest CPU ms/tok"
    return [f"x {REFERENCE} serve (same run; tok/s < 1 and the rest > 1 are overhead)", head, *rows]


# The testbed's WAN emulator processes (``wan-<i>``, ``wan-<cluster>``), by name.
EMULATOR_PREFIX = "wan-"
ENGINE = "engine"


def emulator_share(summary: Mapping[str, Any], engine: Mapping[str, Any] | None) -> dict | None:
    """A stack contender's emulator CPU per token, as a share of the stack's CPU per token and of
    what the stack spends beyond our engine in-process; None for a contender without emulator."""
    per = summary.get("cpu_ms_per_token") or {}
    parts = [v for name, v in per.items() if name.startswith(EMULATOR_PREFIX) and v is not None]
    total = summary.get("cpu_ms_per_token_total")
    if not parts or not total:
        return None
    wan = sum(parts)
    beyond = None
    if engine is not None and (base := engine.get("cpu_ms_per_token_total")) is not None:
        beyond = wan / (total - base) if total > base else None
    return {"ms_per_token": wan, "of_stack": wan / total, "of_gap_to_engine": beyond}


def emulator_table(results: Mapping[int, Mapping[str, dict[str, Any]]]) -> list[str]:
    """The printed lines: every stack contender's emulator share (none without a stack)."""
    rows = []
    for conc, by_name in results.items():
        for name, s in by_name.items():
            share = emulator_share(s, by_name.get(ENGINE))
            if share is None:
                continue
            gap = share["of_gap_to_engine"]
            rows.append(
                f"{conc:>4} {name:<16}{share['ms_per_token']:>15.3f}{share['of_stack']:>15.1%}"
                f"{'-' if gap is None else f'{gap:.1%}':>22}"
            )
    if not rows:
        return []
    head = f"{'conc':>4} {'contender':<16}{'CPU ms/tok':>15}{'of the stack':>15}"
    head += f"{'of the gap to engine':>22}"
    return ["the WAN emulator (testbed only: a real WAN costs no process this CPU)", head, *rows]
