"""Stack B against stack A in one ``pdd bench served`` run (``--b-env``, contenders ``...@b``).

The two stacks serve the same prompts in alternating turns of every round, so the ratio of B's
round to A's round *k* compares a setting with the default through the same moment of a shared,
noisy machine; their median is the figure to read, and their spread says how far to trust it
(an A/A run, ``@b`` contenders with no ``--b-env``, shows the spread with nothing changed).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdd.bench.served_contenders import ON_B


def _tok_s(r: Mapping[str, Any]) -> float:
    return r["output_tokens"] / r["wall_s"] if r["wall_s"] > 0 else 0.0


def _p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _by_contender(
    rounds: Sequence[Mapping[str, Any]],
) -> dict[tuple[int, str], list[Mapping[str, Any]]]:
    """(concurrency, contender) → its rounds, in round order."""
    by: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for r in rounds:
        by.setdefault((r["concurrency"], r["contender"]), []).append(r)
    return by


def paired_ratios(rounds: Sequence[Mapping[str, Any]]) -> dict[tuple[int, str], list[float]]:
    """(concurrency, A's contender) → B's tok/s over A's, round by round (rounds both served)."""
    by = _by_contender(rounds)
    out: dict[tuple[int, str], list[float]] = {}
    for (conc, name), b_rounds in by.items():
        base = name.removesuffix(ON_B)
        if base == name or (conc, base) not in by:
            continue
        pairs = zip(by[conc, base], b_rounds)  # NOTE: in round order: round k with round k
        out[conc, base] = [_tok_s(b) / _tok_s(a) for a, b in pairs if _tok_s(a) > 0]
    return out


def ab_table(rounds: Sequence[Mapping[str, Any]], b_env: Sequence[tuple[str, str]]) -> list[str]:
    """The printed lines: per stack contender served by both, B / A (none without an ``@b``)."""
    ratios = paired_ratios(rounds)
    if not ratios:
        return []
    by = _by_contender(rounds)
    setting = " ".join(f"{k}={v}" for k, v in b_env) or "nothing changed: an A/A run"
    head = (
        f"{'conc':>4} {'contender':<16}{'A tok/s':>9}{'B tok/s':>9}{'B/A':>7}"
        f"{'rounds B/A':>18}{'TTFT B/A':>10}{'TPOT B/A':>10}"
    )
    lines = [f"stack B ({setting}) against stack A, round by round (same prompts)", head]
    for (conc, name), rs in ratios.items():
        a, b = by[conc, name], by[conc, name + ON_B]
        cells = []
        for key in ("ttft_ms", "tpot_ms"):
            pa = _p50([v for r in a for v in r[key]])
            pb = _p50([v for r in b for v in r[key]])
            cells.append(f"{pb / pa:.2f}" if pa and pb is not None else "-")
        spread = f"{min(rs):.2f}-{max(rs):.2f}" if rs else "-"
        lines.append(
            f"{conc:>4} {name:<16}{statistics.median(map(_tok_s, a)):>9.1f}"
            f"{statistics.median(map(_tok_s, b)):>9.1f}"
            f"{statistics.median(rs) if rs else float('nan'):>7.2f}{spread:>18}"
            f"{cells[0]:>10}{cells[1]:>10}"
        )
    return lines
