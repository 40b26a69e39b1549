"""``pdd bench sim``: the discrete-event simulator at the report's scale, and its economics.

Runs ``simulator.simulate`` for each hit distribution and mode, prints the
table, and with ``--goodput`` searches each mode's goodput under the SLA and
PDD's benefit-cost ratio (``economics``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pdd.bench.economics import economics
from pdd.bench.simulator import MODES, SimConfig, fmt, simulate, table
from pdd.bench.trace import DISTS


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench sim [--dist skewed|uniform|both] [--rps 80] [--goodput] [--json OUT] ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        argv = argv[1:]
    d = SimConfig()
    p = argparse.ArgumentParser(prog="pdd bench sim", description=__doc__.split("\n")[0])
    p.add_argument("--dist", choices=(*DISTS, "both"), default="both")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--goodput", action="store_true", help="also search goodput and the benefit-cost ratio"
    )
    p.add_argument("--json", default=None, help="write every run as JSON here")
    for name, value in asdict(d).items():
        if name != "dist":
            p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    a = vars(p.parse_args(argv))
    dists = DISTS if a["dist"] == "both" else (a["dist"],)
    modes = [m.strip() for m in a.pop("modes").split(",") if m.strip()]
    want_goodput, out = a.pop("goodput"), a.pop("json")
    if out and not Path(out).resolve().parent.is_dir():  # NOTE: before the runs, not after them
        p.error(f"--json: no folder {Path(out).resolve().parent}")
    try:
        cfgs = [SimConfig(**{**a, "dist": dist}) for dist in dists]
        runs = [simulate(c, m) for c in cfgs for m in modes]
    except ValueError as e:
        p.error(str(e))
    print(table(runs))
    report: dict = {"runs": runs}
    if want_goodput:
        report["economics"] = {c.dist: economics(c) for c in cfgs}
        for dist, e in report["economics"].items():
            print(
                f"\n{dist}: goodput (RPS meeting P90<{d.sla_p90_s:g}s, P99<{d.sla_p99_s:g}s) "
                + ", ".join(f"{m} {g:.1f}" for m, g in e["goodput_rps"].items())
                + "; cost/h "
                + ", ".join(f"{m} {c:.1f}" for m, c in e["cost_per_hour"].items())
                + "; PDD benefit-cost "
                + ", ".join(
                    f"{k} {fmt(v and 100 * v)}%" for k, v in e["benefit_cost_ratio"].items()
                )
            )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
