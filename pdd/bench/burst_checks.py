"""The burst's verdict (pure): what issue 16 asks of a stack offered 5x its capacity.

From ``burst.report`` and what the run saw of its own stack afterwards:
  - ``survived``: no service process died;
  - ``no_hang``: no request ran into its deadline, and no error but a refusal;
  - ``fast_refusal``: every refusal came within ``refusal_s`` (1 s) of the request;
  - ``goodput``: completions per second during the burst ≥ ``goodput`` (0.9) × capacity;
  - ``ttft_shape``: the accepted requests' TTFT P50 and P90 within ``ttft_factor`` (2) × those
    at capacity (the excess is refused at the door, not queued in front of the accepted ones);
  - ``idle_after``: once the burst has drained, no engine instance holds any of its requests and
    no request, KV reservation or fast-link region is held (the pools are back to idle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd.bench.soak_samples import Check


@dataclass(frozen=True)
class BurstBar:
    goodput: float = 0.9
    refusal_s: float = 1.0
    ttft_factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.goodput <= 1:
            raise ValueError(f"goodput: must be in (0, 1], got {self.goodput}")
        for name in ("refusal_s", "ttft_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


def burst_checks(
    report: Mapping,
    *,
    dead: Sequence[str] | None = None,
    held: Mapping[str, float] | None = None,
    bar: BurstBar = BurstBar(),
) -> list[Check]:
    """``report``: ``burst.report``'s numbers; ``dead``: service processes that exited;
    ``held``: "what is held where" (e.g. ``relay-0 requests_held``) → how many, after the drain.
    Against a gateway the run did not start, neither is known (None): those checks are left out."""
    checks = []
    if dead is not None:
        detail = ", ".join(dead) + " exited" if dead else "every process"
        checks.append(Check("survived", not dead, detail))
    hung, other = report["hung_past_deadline"], report["other_errors"]
    checks.append(
        Check(
            "no_hang",
            not hung and not other,
            f"{hung} past the deadline, other errors {dict(other) or 'none'}",
        )
    )
    worst = report["refusal_ms_max"]
    checks.append(
        Check(
            "fast_refusal",
            worst is None or worst <= bar.refusal_s * 1000,
            f"{report['refused']} refused, slowest {worst} ms (bar {bar.refusal_s * 1000:g} ms)",
        )
    )
    ratio = report["goodput_vs_capacity"] or 0.0
    checks.append(
        Check(
            "goodput",
            ratio >= bar.goodput,
            f"{report['completed_rps']}/s = {ratio:.2f} x capacity {report['capacity_rps']}/s "
            f"(bar {bar.goodput:g} x)",
        )
    )
    cap, acc = report["ttft_ms_at_capacity"], report["ttft_ms_accepted_in_burst"]
    factors = {
        q: (acc[q] / cap[q]) if acc.get(q) is not None and cap.get(q) else None
        for q in ("p50", "p90")
    }
    checks.append(
        Check(
            "ttft_shape",
            all(f is not None and f <= bar.ttft_factor for f in factors.values()),
            " ".join(
                f"{q.upper()} {acc[q]} vs {cap[q]} ms"
                + (f" ({f:.2f} x)" if f is not None else " (none)")
                for q, f in factors.items()
            )
            + f" (bar {bar.ttft_factor:g} x)",
        )
    )
    if held is not None:
        holding = {k: v for k, v in held.items() if v}
        checks.append(
            Check(
                "idle_after",
                not holding,
                ", ".join(f"{k}={v:g}" for k, v in sorted(holding.items())) or "nothing held",
            )
        )
    return checks
