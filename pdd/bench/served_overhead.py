"""``pdd bench served``'s overhead table: every contender as a ratio to ``vllm serve``.

The main table gives each contender's own figures; this one answers the issue's question for
PDD on vLLM (``stack-vllm``: the same engine behind PDD's gateway, prefill, WAN link and
MainDecode) in one line per contender: throughput, TTFT, TPOT and CPU per token, each divided
by vLLM's own OpenAI server's in the same run, and where the extra CPU goes (the processes
whose CPU per token is largest). A throughput ratio below 1 and the others above 1 are the
stack's overhead.
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


def _div(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def overhead(summary: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float | None]:
    """One contender's summary over the reference's, key by key (None where either is unknown)."""
    return {key: _div(summary.get(key), reference.get(key)) for key, _ in RATIOS}


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
