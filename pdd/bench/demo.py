"""``pdd demo``: the main job — one agentic trace through IDC-PD, CDC-PD and PDD, side by side.

Life of a demo:
  1. generate the preset's agentic trace (skewed hits, sessions whose turns
     embed earlier outputs) and write it to the report folder;
  2. measure the testbed's yardsticks in process, before any stack runs: the
     idle decode step and KV bytes per token (``calibrate``);
  3. for each mode, start its own stack, replay the trace, stop the stack
     (``runner.run_mode``: RESULT + per-request records + CPU per service);
  4. print the side-by-side table and the targets, and write report.md with the
     TTFT/TTFDT CDFs, one P-RLD-MD request's timeline, the scale mapping and the
     CPU contention measured.
Exit status: 1 if any request failed or any service exited uncleanly, else 0
(missed targets are reported, not fatal).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pdd.bench import agreement, calibrate, modes, report, targets
from pdd.bench.record import RequestResult
from pdd.bench.runner import DEFAULT_SLO, ModeOutcome, add_testbed_flags, run_mode, testbed_from
from pdd.bench.trace import TraceConfig, describe, generate, write_trace

# The report's scale (arXiv 2609.13161; the simulator's defaults): what the testbed's ratios are held against.
REPORT_CONTEXT_TOKENS = 65536
REPORT_KV_BYTES_PER_TOKEN = 160_000
REPORT_WAN_GBPS = 20.0
REPORT_STEP_MS = 30.0

PRESETS = {
    # `make demo`: 40 requests of 10 agent sessions arriving over ~19 s (at most 2 sessions live in trace
    # time; the real run, slower than the trace, keeps ~3-4 requests in flight); ~3 minutes on 2 cores.
    "quick": TraceConfig(
        sessions=10,
        turns=4,
        rps=2.0,
        dist="skewed",
        seed=0,
        prompt_tokens=1024,
        max_context_tokens=4096,
        output_scale=2.0,
        vocab_high=4096,
        concurrent_sessions=2,
    ),
    # `make bench`: 80 requests, longer sessions, another seed, arrivals over ~80 s (~6 minutes).
    "full": TraceConfig(
        sessions=16,
        turns=5,
        rps=1.0,
        dist="skewed",
        seed=1,
        prompt_tokens=1024,
        max_context_tokens=4096,
        output_scale=2.0,
        vocab_high=4096,
        concurrent_sessions=3,
    ),
}


@dataclass(frozen=True)
class DemoConfig:
    out: Path = Path("pdd-report")
    trace: TraceConfig = PRESETS["quick"]
    testbed: modes.Testbed = field(default_factory=modes.Testbed)
    modes: tuple[str, ...] = modes.MODES
    slo: str = DEFAULT_SLO
    redis_url: str = ""

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("modes: at least one")
        for m in self.modes:
            modes.check_mode(m)


def scale_section(
    cfg: DemoConfig,
    step_ms: float,
    kv_bytes: int,
    prompt_mean: float,
    outcomes: Mapping[str, ModeOutcome],
) -> str:
    tb = cfg.testbed
    ours_full = calibrate.link_ms(prompt_mean * kv_bytes, tb.wan_mbps)
    theirs_full = calibrate.link_ms(
        REPORT_CONTEXT_TOKENS * REPORT_KV_BYTES_PER_TOKEN, REPORT_WAN_GBPS * 1000
    )
    lines = [
        "## Scale",
        "",
        "| | report | this testbed |",
        "|---|---:|---:|",
        f"| context (mean prompt) | {REPORT_CONTEXT_TOKENS} tokens | {prompt_mean:.0f} tokens |",
        f"| KV per token | {REPORT_KV_BYTES_PER_TOKEN / 1000:.0f} KB | {kv_bytes / 1000:.1f} KB |",
        f"| WAN | {REPORT_WAN_GBPS:g} Gbps | {tb.wan_mbps:g} Mbps, {tb.wan_delay_ms:g} ms one way |",
        f"| decode step | {REPORT_STEP_MS:g} ms | {step_ms:.2f} ms idle (batch 1, {tb.threads} thread) |",
        f"| whole-context KV over the WAN | {theirs_full:.0f} ms = {theirs_full / REPORT_STEP_MS:.0f} steps "
        f"| {ours_full:.0f} ms = {ours_full / step_ms:.0f} idle steps |",
        "",
    ]
    o = outcomes.get("cdc-pd") or outcomes.get("pdd")
    if o is not None:
        loaded = o.result["itl_ms"]["p50"] or step_ms
        lines += [
            f"Measured in the {o.result['mode']} run, split at the router's threshold (MainDecode hit "
            f"< or ≥ {tb.hit_threshold:g}); P50 / max over requests, in decode steps:",
            "",
            "| WAN transfer of the delta | low-hit | high-hit |",
            "|---|---:|---:|",
        ]
        for label, mbps, step in (
            ("link time (bytes ÷ bandwidth), idle steps", tb.wan_mbps, step_ms),
            (f"link time, loaded steps (ITL P50 {loaded:.1f} ms)", tb.wan_mbps, loaded),
            ("push time measured by prefill (overlaps its compute), loaded steps", None, loaded),
        ):
            t = calibrate.transfer_steps(o.records, step, tb.hit_threshold, mbps)
            cells = [
                "-"
                if not v["requests"]
                else f"{v['p50']:.0f} / {v['max']:.0f} ({v['requests']} req)"
                for v in (t["low_hit"], t["high_hit"])
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def in_flight(records: Sequence[RequestResult]) -> tuple[float, int]:
    """(time-averaged, peak) number of requests in flight: the load the arrivals built up."""
    edges = sorted(
        [(r.start_ms, 1) for r in records if r.e2el_ms is not None]
        + [(r.start_ms + r.e2el_ms, -1) for r in records if r.e2el_ms is not None]
    )
    if not edges:
        return 0.0, 0
    now = peak = 0
    area, last = 0.0, edges[0][0]
    for t, step in edges:
        area += now * (t - last)
        last, now = t, now + step
        peak = max(peak, now)
    span = edges[-1][0] - edges[0][0]
    return (area / span if span > 0 else 0.0), peak


def cpu_section(step_ms: float, outcomes: Mapping[str, ModeOutcome]) -> str:
    names: list[str] = []
    for o in outcomes.values():
        names += [n for n in (o.result["cpu"].get("services") or {}) if n not in names]
    lines = [
        "## CPU contention",
        "",
        "Cores each process used on average during the run (user + system time ÷ wall time), per "
        "cluster, what other processes on the host took meanwhile (machine busy time − ours), and how "
        "much slower a decode step is under load than idle.",
        "",
        "| | " + " | ".join(outcomes) + " |",
        "|---|" + "---:|" * len(outcomes),
    ]
    cpu = {m: o.result["cpu"] for m, o in outcomes.items()}
    lines.append(
        "| machine busy | "
        + " | ".join(
            "-"
            if c.get("machine_busy") is None
            else f"{100 * c['machine_busy']:.0f}% of {c['cores']} cores"
            for c in cpu.values()
        )
        + " |"
    )
    for n in names:
        cells = [(c.get("services") or {}).get(n) for c in cpu.values()]
        lines.append(
            f"| {n} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |"
        )
    rows = [
        ("**ours, all processes**", lambda c: c.get("total_cores_used")),
        ("main cluster (pinned)", lambda c: (c.get("clusters") or {}).get("main")),
        ("remote cluster (pinned)", lambda c: (c.get("clusters") or {}).get("remote")),
        ("**other processes on the host**", lambda c: c.get("others_cores")),
    ]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(_f(get(c)) for c in cpu.values()) + " |")
    loads = [in_flight(o.records) for o in outcomes.values()]
    lines.append(
        "| requests in flight, mean / max | "
        + " | ".join(f"{a:.1f} / {b}" for a, b in loads)
        + " |"
    )
    lines.append(
        "| ITL P50 ÷ idle step | "
        + " | ".join(
            "-" if not o.result["itl_ms"]["p50"] else f"{o.result['itl_ms']['p50'] / step_ms:.1f}×"
            for o in outcomes.values()
        )
        + " |"
    )
    return "\n".join(lines)


def targets_section(ts: Sequence[targets.Target]) -> str:
    return "\n".join(["## Targets", "", *(f"- {t.line()}" for t in ts)])


READING = """## Reading the table

- **TTFT** is the first token the client receives. In P-MD and P-RLD-MD prefill samples it and the
  gateway streams it at once, so there TTFT measures prefill (and its queue) only.
- **TTFDT** (time to first decode token) is the first token a *decode* stage produced: the relay's in
  P-RLD-MD, MainDecode's in P-MD, which waits for the KV delta to cross the link. It is what the
  report calls TTFT (its users see no token before decoding starts), and what the TTFT targets judge.
- **MD-only** requests (PDD's router, MainDecode lacks ≤ `--local-prefill-tokens` of the prompt) skip
  prefill and the WAN: MainDecode prefills the short suffix in its own batch, so TTFT = TTFDT.
- **goodput** counts requests meeting every per-request SLO ({slo}) per second of the run.
- **handoff gap**: the client-side gap between the relay's last token and MainDecode's first.
  During a catch-up the relay streams no faster than MainDecode decodes and releases what it holds
  when MainDecode takes over, so the stall that used to sit at the switch is spread out; the
  **handoff window** (the longest gap within 8 tokens either side of the switch) shows whether it
  was spread or only moved — compare it with ITL P99 and the timeline plot.
- **CPU busy**: the whole machine, including processes that are not ours (see CPU contention)."""


def run_demo(cfg: DemoConfig) -> int:
    t0 = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    trace = generate(cfg.trace)
    write_trace(trace, cfg.out / "trace.jsonl")
    print(f"[pdd demo] trace: {describe(trace)}", flush=True)
    step_ms = calibrate.idle_step_ms(
        cfg.testbed.model, threads=cfg.testbed.threads, block_size=cfg.testbed.block_size
    )
    kv_bytes = calibrate.kv_bytes_per_token(cfg.testbed.model)
    print(
        f"[pdd demo] testbed: idle decode step {step_ms:.2f} ms, {kv_bytes} B of KV per token, "
        f"WAN {cfg.testbed.wan_mbps:g} Mbps / {cfg.testbed.wan_delay_ms:g} ms",
        flush=True,
    )
    outcomes: dict[str, ModeOutcome] = {}
    for mode in cfg.modes:
        print(
            f"[pdd demo] {mode}: starting its stack ({modes.relays(mode)} relay, "
            f"link {'unshaped' if mode == 'idc-pd' else 'shaped'})",
            flush=True,
        )
        outcomes[mode] = run_mode(
            trace,
            mode,
            cfg.out / f"{mode}.json",
            testbed=cfg.testbed,
            log_dir=cfg.out / "logs" / mode,
            redis_url=cfg.redis_url,
            slo=cfg.slo,
            load={"progress": True},
        )
    results = [o.result for o in outcomes.values()]
    diverged = agreement.divergences(
        trace, {m: r["outputs"] for m, r in zip(outcomes, results)}, cfg.testbed.model
    )
    ts = targets.evaluate(results, divergences=diverged)
    prompt_mean = float(np.mean([len(r.prompt_token_ids) for r in trace]))
    sections = [
        READING.format(slo=cfg.slo),
        targets_section(ts),
        scale_section(cfg, step_ms, kv_bytes, prompt_mean, outcomes),
        cpu_section(step_ms, outcomes),
    ]
    path = report.write_report(
        results, cfg.out, records={m: o.records for m, o in outcomes.items()}, sections=sections
    )
    print()
    print(report.compare(results))
    print()
    print("\n".join(t.line() for t in ts))
    for mode, o in outcomes.items():
        c = o.result["cpu"]
        clusters = ", ".join(f"{k} {v:.2f}" for k, v in (c.get("clusters") or {}).items())
        print(
            f"cpu {mode}: ours {_f(c.get('total_cores_used'))} cores ({clusters or 'unpinned'}), "
            f"other processes {_f(c.get('others_cores'))} of {c.get('cores')} cores"
        )
    unclean = {m: o.unclean for m, o in outcomes.items() if o.unclean}
    if unclean:
        print(f"services exited uncleanly: {unclean}", file=sys.stderr)
    print(
        f"\nreport: {path} (plots, RESULT json and records per mode in {cfg.out}/), "
        f"{time.monotonic() - t0:.0f} s"
    )
    failed = any(r["errors"] for r in results) or bool(unclean)
    return 1 if failed else 0


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd demo [--preset quick|full] [--out DIR] [--modes idc-pd,cdc-pd,pdd] [testbed flags]``."""
    p = argparse.ArgumentParser(prog="pdd demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="quick",
        help="quick: `make demo` (40 requests); full: `make bench` (80 requests)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default pdd-report, or pdd-report-full for --preset full)",
    )
    p.add_argument("--modes", default=",".join(modes.MODES))
    p.add_argument("--sessions", type=int, default=None, help="override the preset's session count")
    p.add_argument(
        "--dist", choices=("skewed", "uniform"), default=None, help="override the preset's hit skew"
    )
    p.add_argument("--slo", default=DEFAULT_SLO)
    p.add_argument("--redis-url", default="")
    add_testbed_flags(p)
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        trace = PRESETS[a.preset]
        if a.sessions is not None:
            trace = replace(trace, sessions=a.sessions)
        if a.dist is not None:
            trace = replace(trace, dist=a.dist)
        out = a.out or Path("pdd-report" if a.preset == "quick" else "pdd-report-full")
        cfg = DemoConfig(
            out=out,
            trace=trace,
            testbed=testbed_from(a),
            slo=a.slo,
            redis_url=a.redis_url,
            modes=tuple(m.strip() for m in a.modes.split(",") if m.strip()),
        )
    except ValueError as e:
        p.error(str(e))
    return run_demo(cfg)


if __name__ == "__main__":
    sys.exit(main())
