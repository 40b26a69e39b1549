"""The demo's pass/fail targets, judged on RESULTs measured side by side.

  PDD P90 TTFDT ≤ 0.55 × CDC-PD's      (the report: 18.3 s → 9.8 s, ×0.54)
  PDD P90 TTFDT ≤ 1.1 × IDC-PD's       (the report: 10.4 s vs 9.8 s)
  RLD token share ≤ 10%                (the report: 6.2%)
  handoff gap P99 ≤ 3 × median ITL     (one-shot's single stall stays small)
  zero errors, in every mode
  identical greedy outputs in every mode — up to near-ties (``agreement``):
    a request that differs only at a near-tie, or only because an earlier
    turn of its session did, is accepted and listed
The two TTFT ratios are judged on TTFDT, the first token a decode stage
produced (see ``metrics``), which is what the report's TTFT measures; the same
ratios on TTFT proper (prefill's token, streamed at once) are listed too, as
information: they are ~1 by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd.bench.agreement import Divergence
from pdd.bench.report import output_agreement


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    limit: float | None
    # None: informational, not a pass/fail target.
    met: bool | None
    detail: str = ""
    op: str = "≤"

    def line(self) -> str:
        verdict = {True: "MET   ", False: "MISSED", None: "info  "}[self.met]
        value = "-" if self.value is None else f"{self.value:.3g}"
        limit = "" if self.limit is None else f" (target {self.op} {self.limit:g})"
        return f"{verdict} {self.name}: {value}{limit}" + (
            f"; {self.detail}" if self.detail else ""
        )


def _p(result: Mapping | None, key: str, q: str) -> float | None:
    return None if result is None else (result.get(key) or {}).get(q)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _at_most(
    name: str, value: float | None, limit: float, detail: str = "", informational: bool = False
) -> Target:
    met = None if informational else (value is not None and value <= limit)
    return Target(name, value, limit, met, detail)


def evaluate(
    results: Sequence[Mapping],
    subject: str = "pdd",
    divergences: Sequence[Divergence] | None = None,
) -> list[Target]:
    """Every target that the given modes allow judging (a missing mode skips its ratios).

    ``divergences`` (``agreement.divergences``) explains the requests whose outputs differ;
    without it any difference misses the output target.
    """
    by_mode = {r["mode"]: r for r in results}
    pdd = by_mode.get(subject)
    out: list[Target] = []
    # NOTE: the report's TTFT targets are judged on TTFDT; TTFT (prefill's token) is information.
    for key, label, info in (
        ("ttfdt_ms", "TTFDT", False),
        ("ttft_ms", "TTFT (prefill's token)", True),
    ):
        for other, limit in (("cdc-pd", 0.55), ("idc-pd", 1.1)):
            if pdd is None or other not in by_mode:
                continue
            a, b = _p(pdd, key, "p90"), _p(by_mode[other], key, "p90")
            out.append(
                _at_most(
                    f"{subject} P90 {label} ÷ {other}",
                    _ratio(a, b),
                    limit,
                    f"{_ms(a)} vs {_ms(b)}",
                    informational=info,
                )
            )
    if pdd is not None:
        share = pdd["rld_token_share"]
        out.append(_at_most("RLD token share", share, 0.10))
        gap, itl = _p(pdd, "handoff_gap_ms", "p99"), _p(pdd, "itl_ms", "p50")
        handoffs = (
            "no request handed off" if gap is None else f"gap P99 {_ms(gap)}, ITL P50 {_ms(itl)}"
        )
        out.append(_at_most("handoff gap P99 ÷ median ITL", _ratio(gap, itl), 3.0, handoffs))
    errors = sum(r["errors"] for r in results)
    out.append(
        Target(
            "errors, all modes",
            float(errors),
            0.0,
            errors == 0,
            ", ".join(f"{r['mode']} {r['errors']}/{r['requests']}" for r in results),
            op="=",
        )
    )
    if len(results) > 1:
        same, total = output_agreement(results)
        met, detail = total > 0 and same == total, f"{same}/{total} requests"
        if total and same < total and divergences is not None:
            kinds = [d.kind for d in divergences]
            met = "real" not in kinds and len(divergences) == total - same
            detail += (
                f"; differing: {kinds.count('near-tie')} at a near-tie, {kinds.count('cascade')} only "
                f"through an earlier turn's output, {kinds.count('real')} real: "
                + "; ".join(d.describe() for d in divergences if d.kind != "cascade")
            )
        out.append(
            Target(
                "identical greedy outputs across modes (up to near-ties)",
                same / total if total else None,
                1.0,
                met,
                detail,
                op="=",
            )
        )
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def all_met(targets: Sequence[Target]) -> bool:
    return all(t.met for t in targets if t.met is not None)
