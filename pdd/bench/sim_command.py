"""``pdd bench sim``: the discrete-event simulator at the report's scale, and its economics.

Runs ``simulator.simulate`` for each hit distribution and mode and prints the table; with
``--goodput`` searches each mode's goodput under the SLA and PDD's benefit-cost ratio
(``economics``); ``--report`` prints the report's figures beside the simulated ones with the error
of each (``sim_report``); ``--validate`` replays the recorded ``pdd bench`` run with this machine's
profile and prints the check (``sim_validate``); ``--digest DIR --json OUT`` records a ``pdd demo``
folder as such a run (``profiles/demo_run.json``'s form).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pdd.bench import sim_report, sim_validate
from pdd.bench.economics import economics
from pdd.bench.sim_summary import fmt, table
from pdd.bench.simulator import MODES, SimConfig, simulate
from pdd.bench.trace import DISTS


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench sim [--dist skewed|uniform|both] [--rps R] [--goodput] [--report] [--validate]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        argv = argv[1:]
    d = SimConfig()
    p = argparse.ArgumentParser(prog="pdd bench sim", description=__doc__.split("\n")[0])
    p.add_argument("--dist", choices=(*DISTS, "both"), default="both")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--goodput", action="store_true", help="also search goodput and benefit-cost")
    p.add_argument(
        "--report", action="store_true", help="the report's figures, simulated vs report"
    )
    p.add_argument("--validate", action="store_true", help="check against the recorded bench run")
    p.add_argument(
        "--recorded", default=str(sim_validate.RECORDED), help="the recorded run --validate replays"
    )
    p.add_argument("--digest", default=None, help="a `pdd demo` folder to record (with --json)")
    p.add_argument("--json", default=None, help="write every run as JSON here")
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # NOTE: type=bool would read "False" as True
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif name != "dist":
            p.add_argument(flag, type=type(value), default=value)
    a = vars(p.parse_args(argv))
    dists = DISTS if a["dist"] == "both" else (a["dist"],)
    modes = [m.strip() for m in a.pop("modes").split(",") if m.strip()]
    want_goodput, out = a.pop("goodput"), a.pop("json")
    want_report, want_validate = a.pop("report"), a.pop("validate")
    recorded, digest_dir = a.pop("recorded"), a.pop("digest")
    if out and not Path(out).resolve().parent.is_dir():  # NOTE: before the runs, not after them
        p.error(f"--json: no folder {Path(out).resolve().parent}")
    if digest_dir is not None:
        if not out:
            p.error("--digest: needs --json OUT (where the recorded run goes)")
        if not (Path(digest_dir) / "trace.jsonl").is_file():
            p.error(f"--digest: no trace.jsonl in {digest_dir}")
        Path(out).write_text(json.dumps(sim_validate.digest(digest_dir), indent=0) + "\n")
        print(f"wrote {out}")
        return 0
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: choose from {', '.join(MODES)}, got {','.join(bad) or 'none'}")
    try:
        cfgs = [SimConfig(**{**a, "dist": dist}) for dist in dists]
        if want_validate:
            # NOTE: the replay's profile is this machine's (testbed) unless one was named
            args = sys.argv[1:] if argv is None else argv
            named = any(x == "--profile" or x.startswith("--profile=") for x in args)
            rows = sim_validate.validate(recorded, profile=a["profile"] if named else "testbed")
            print(sim_validate.table(rows))
            return 0 if all(r["ok"] for r in rows) else 1
        if want_report:
            rows = sim_report.compare(cfgs[0], goodput=want_goodput)
            print(sim_report.table(rows, cfgs[0]))
            return 0
        runs = [simulate(c, m) for c in cfgs for m in modes]
    except ValueError as e:
        p.error(str(e))
    print(table(runs))
    report: dict = {"runs": runs}
    if want_goodput:
        report["economics"] = {c.dist: economics(c, modes=modes) for c in cfgs}
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
