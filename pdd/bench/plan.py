"""``pdd plan``: size a deployment — the pools and the router's threshold with the best benefit-cost.

For every combination of the candidate pool sizes (prefill, relay, MainDecode per remote cluster)
and hit thresholds, the simulator's goodput search (``economics.goodput_rps``) finds the largest RPS
meeting the SLA; cost per hour is the instances × unit prices + the WAN lines. Printed: every point
(goodput, cost, goodput per cost) with the frontier marked — no other point has more goodput for
less cost — and IDC-PD's points for the same prefill sizes as the baseline; ``--plot`` draws goodput
vs cost per mode.

    pdd plan [--profile report] [--dist skewed] [--prefill 6,8] [--relay 1,3] [--md 4,8]
             [--threshold 0.95] [--sla-p90 10 --sla-p99 15] [--prices 1,0.727,0.05] [--plot F.png]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pdd.bench.economics import Prices, cost_per_hour, goodput_rps
from pdd.bench.sim_profile import load_profile
from pdd.bench.simulator import SimConfig


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {s!r}")
    return out


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def search(
    base: SimConfig, prefill, relay, md, thresholds, prices: Prices, steps: int
) -> list[dict]:
    prof = load_profile(base.profile)
    points = []
    for p in prefill:
        cfg = replace(base, idc_prefill_instances=p, prefill_instances=p)
        for d in sorted(set(md)):
            c = replace(cfg, idc_decode_instances=d)
            points.append(_point(c, "idc-pd", prof, prices, steps, prefill=p, decode=d))
    for p, r, d, th in itertools.product(prefill, relay, md, thresholds):
        cfg = replace(
            base,
            prefill_instances=p,
            relay_instances=r,
            md_instances=d * base.remote_clusters,
            hit_threshold=th,
        )
        points.append(
            _point(cfg, "pdd", prof, prices, steps, prefill=p, relay=r, md=d, threshold=th)
        )
    for mode in ("idc-pd", "pdd"):
        mine = [q for q in points if q["mode"] == mode]
        for q in mine:
            q["frontier"] = not any(
                o["goodput_rps"] >= q["goodput_rps"]
                and o["cost"] <= q["cost"]
                and (o["goodput_rps"], -o["cost"]) != (q["goodput_rps"], -q["cost"])
                for o in mine
            )
    return points


def _point(cfg, mode, prof, prices, steps, **sizes) -> dict:
    g = goodput_rps(cfg, mode, prof, steps=steps)
    cost = cost_per_hour(cfg, mode, prices)
    return {
        "mode": mode,
        **sizes,
        "goodput_rps": g,
        "cost": cost,
        "per_cost": g / cost if cost else 0.0,
    }


def table(points: Sequence[dict]) -> str:
    head = f"{'mode':<7} {'P':>3} {'RLD':>3} {'MD/D':>4} {'θ':>5} {'goodput':>8} {'cost/h':>7} {'RPS/cost':>8}  frontier"
    lines = [head, "-" * len(head)]
    for q in sorted(points, key=lambda q: (q["mode"], -q["per_cost"])):
        lines.append(
            f"{q['mode']:<7} {q['prefill']:>3} {q.get('relay', 0):>3} "
            f"{q.get('md', q.get('decode', 0)):>4} {q.get('threshold', 0):>5.2f} "
            f"{q['goodput_rps']:>8.2f} {q['cost']:>7.2f} {q['per_cost']:>8.3f}  "
            f"{'*' if q['frontier'] else ''}"
        )
    best = {
        m: max((q for q in points if q["mode"] == m), key=lambda q: q["per_cost"])
        for m in ("idc-pd", "pdd")
    }
    if best["idc-pd"]["per_cost"]:
        bcr = best["pdd"]["per_cost"] / best["idc-pd"]["per_cost"] - 1
        lines.append(f"best PDD vs best IDC-PD: benefit-cost {bcr:+.1%}")
    return "\n".join(lines)


def plot(points: Sequence[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("idc-pd", "s"), ("pdd", "o")):
        mine = sorted((q for q in points if q["mode"] == mode), key=lambda q: q["cost"])
        ax.scatter(
            [q["cost"] for q in mine],
            [q["goodput_rps"] for q in mine],
            marker=marker,
            label=mode,
            alpha=0.5,
        )
        front = [q for q in mine if q["frontier"]]
        ax.plot([q["cost"] for q in front], [q["goodput_rps"] for q in front], marker=marker)
    ax.set_xlabel("cost per hour (flagship instance-hours)")
    ax.set_ylabel("goodput (RPS meeting the SLA)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    d = SimConfig()
    p = argparse.ArgumentParser(prog="pdd plan", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--dist", default=d.dist)
    p.add_argument("--context-tokens", type=int, default=d.context_tokens)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--remote-clusters", type=int, default=d.remote_clusters)
    p.add_argument(
        "--wan-gbps", type=float, default=d.wan_gbps, help="per remote cluster; 0 = profile's"
    )
    p.add_argument("--prefill", type=_ints, default=[6, 8])
    p.add_argument("--relay", type=_ints, default=[1])
    p.add_argument("--md", type=_ints, default=[4, 8], help="MainDecode per remote cluster")
    p.add_argument("--threshold", type=_floats, default=[d.hit_threshold])
    p.add_argument("--sla-p90", type=float, default=d.sla_p90_s)
    p.add_argument("--sla-p99", type=float, default=d.sla_p99_s)
    p.add_argument(
        "--prices",
        type=_floats,
        default=[Prices().flagship, Prices().bandwidth, Prices().wan_line],
        help="flagship,bandwidth,wan line (economics.Prices: the MainDecode chip's is derived)",
    )
    p.add_argument("--max-rps", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=5, help="bisection steps per point")
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    if a.plot and not Path(a.plot).resolve().parent.is_dir():
        p.error(f"--plot: no folder {Path(a.plot).resolve().parent}")
    if len(a.prices) != 3:
        p.error("--prices: expected flagship,bandwidth,wan_line")
    if a.steps < 1:
        p.error("--steps: must be >= 1")
    try:
        base = SimConfig(
            profile=a.profile,
            dist=a.dist,
            context_tokens=a.context_tokens,
            duration_s=a.duration_s,
            warmup_s=min(60.0, a.duration_s / 5),
            remote_clusters=a.remote_clusters,
            wan_gbps=a.wan_gbps,
            sla_p90_s=a.sla_p90,
            sla_p99_s=a.sla_p99,
            rps=a.max_rps / 2,
        )
        load_profile(base.profile)
        prices = Prices(*a.prices)
        if min(a.md) < 1 or min(a.prefill) < 1:
            raise ValueError("--prefill/--md: every pool needs at least one instance")
        points = search(
            base, a.prefill, a.relay, a.md, a.threshold or [d.hit_threshold], prices, a.steps
        )
    except ValueError as e:
        p.error(str(e))
    print(table(points))
    if a.plot:
        plot(points, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
