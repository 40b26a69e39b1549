"""Capacity and cost from the simulator: goodput under the SLA, cost, benefit-cost ratio.

Goodput is the largest arrival rate at which a mode still meets the SLA of
``SimConfig`` (P90 TTFT < ``sla_p90_s`` and P99 < ``sla_p99_s``), found by
bisection on ``rps`` with everything else (seed, hit draws, lengths) fixed. Cost
per hour sums instances × unit price (flagships for prefill and IDC decode,
bandwidth-strong chips for relay and MainDecode) plus WAN Gbps × price. The
benefit-cost ratio of PDD against a baseline is (goodput / cost)_PDD ÷
(goodput / cost)_baseline − 1.
"""

from __future__ import annotations

from dataclasses import replace

from pdd.bench.simulator import MODES, SimConfig, simulate


def goodput_rps(cfg: SimConfig, mode: str, hi: float | None = None, steps: int = 10) -> float:
    """The largest RPS (within 2^-steps of ``hi``) at which ``mode`` still meets the SLA."""
    lo, hi = 0.0, hi or 2 * cfg.rps
    for _ in range(steps):
        mid = (lo + hi) / 2
        if simulate(replace(cfg, rps=mid), mode)["sla_met"]:
            lo = mid
        else:
            hi = mid
    return lo


def cost_per_hour(cfg: SimConfig, mode: str) -> float:
    if mode == "idc-pd":
        return (cfg.idc_prefill_instances + cfg.idc_decode_instances) * cfg.flagship_price
    chips = cfg.md_instances + (cfg.relay_instances if mode == "pdd" else 0)
    wan = cfg.wan_links * cfg.wan_gbps * cfg.wan_price_per_gbps
    return cfg.prefill_instances * cfg.flagship_price + chips * cfg.bandwidth_chip_price + wan


def economics(cfg: SimConfig, steps: int = 10) -> dict:
    """Goodput and cost of each mode, and PDD's benefit-cost ratio against the two baselines."""
    good = {m: goodput_rps(cfg, m, steps=steps) for m in MODES}
    cost = {m: cost_per_hour(cfg, m) for m in MODES}
    per = {m: good[m] / cost[m] for m in MODES}
    bcr = {f"vs_{m}": (per["pdd"] / per[m] - 1 if per[m] else None) for m in ("idc-pd", "cdc-pd")}
    return {"goodput_rps": good, "cost_per_hour": cost, "benefit_cost_ratio": bcr}
