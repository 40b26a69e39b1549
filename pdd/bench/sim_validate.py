"""The simulator checked against a recorded ``pdd bench`` run before it is trusted at scale.

The recorded run (``profiles/demo_run.json``: the demo trace's shape per request and each mode's
measured TTFDT and RLD share; ``digest`` writes it from a ``pdd demo`` folder) is replayed through
the simulator with this machine's profile (``profiles/testbed.json``, written by ``pdd bench
calibrate``) on the testbed's deployment (one prefill, one MainDecode, one relay in PDD; the WAN
emulator's bandwidth and delay; the bench's router settings). Each mode's P50 / P90 TTFDT and RLD
share must come within ``TOLERANCE``.

A first turn's prompt opens with part of the one system prompt every session shares; its
``expected_hit`` is only what *earlier* requests held of it (0 for the very first request), so
the replay takes the system prompt's length from ``system_tokens``: the longest prefix the turn
shares with any other first turn, which is what a cache holding it can serve to another session.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdd.bench.sim_profile import PROFILES, Profile, load_profile
from pdd.bench.sim_workload import SimRequest
from pdd.bench.simulator import MODES, SimConfig, simulate

TOLERANCE = 0.20
RECORDED = PROFILES / "demo_run.json"
COLUMNS = (
    "timestamp_ms",
    "session_id",
    "turn",
    "prompt_tokens",
    "max_tokens",
    "expected_hit",
    "first_turn",
)


def recorded_requests(d: dict) -> list[SimRequest]:
    cols = d["columns"]
    rows = [dict(zip(cols, row)) for row in d["trace"]]
    rows.sort(key=lambda r: r["timestamp_ms"])
    t0 = rows[0]["timestamp_ms"]
    sess: dict[str, int] = {}
    last: dict[str, int] = {}
    system: dict[str, int] = {}
    out = []
    for rid, r in enumerate(rows):
        n, sid = r["prompt_tokens"], r["session_id"]
        shared = int(round(r["expected_hit"] * n))
        if r["first_turn"]:
            # NOTE: older digests lack the column: the hit on earlier requests is a lower bound.
            system[sid] = max(shared, r.get("system_tokens", 0))
        out.append(
            SimRequest(
                rid=rid,
                arrival=(r["timestamp_ms"] - t0) / 1e3,
                session=sess.setdefault(sid, len(sess)),
                prompt=n,
                reuse=0 if r["first_turn"] else shared,
                system=system.get(sid, 0),
                output=r["max_tokens"],
                target_hit=r["expected_hit"],
                prev=last.get(sid, -1),
            )
        )
        last[sid] = rid
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def digest(report_dir: str | Path, testbed=None) -> dict:
    """A ``pdd demo`` folder (``trace.jsonl`` + ``<mode>.json``) as ``demo_run.json`` holds it."""
    from pdd.bench.modes import Testbed
    from pdd.bench.trace import read_trace
    from pdd.routing.policy import RoutingConfig

    tb, router = testbed or Testbed(), RoutingConfig()  # NOTE: the bench's gateway: the defaults
    root = Path(report_dir)
    trace = read_trace(root / "trace.jsonl")
    firsts = [t.prompt_token_ids for t in trace if t.turn == 0]
    cols = [*COLUMNS, "system_tokens"]
    rows = []
    for t in trace:
        first = t.turn == 0
        own = t.prompt_token_ids
        sys_len = (
            max((_common_prefix(own, o) for o in firsts if o is not own), default=0) if first else 0
        )
        rows.append(
            [t.timestamp_ms, t.session_id, t.turn, len(own), t.max_tokens, t.expected_hit]
            + [int(first), sys_len]
        )
    results = {}
    for mode in MODES:
        r = json.loads((root / f"{mode}.json").read_text())
        results[mode] = {
            "ttfdt_ms": r["ttfdt_ms"],
            "rld_token_share": r["rld_token_share"] or 0.0,
            "pipelines": r["pipelines"],
            "duration_s": r["duration_s"],
            "itl_ms_p50": r["itl_ms"]["p50"],
            "link": r["link"],
            "cpu": r.get("cpu"),
        }
    return {
        "_about": f"A recorded `pdd demo` (digested by `pdd bench sim --digest {root}`)",
        "columns": cols,
        "trace": rows,
        "testbed": {
            "prefill": 1,
            "relay": 1,
            "main_decode": 1,
            "local_prefill_tokens": tb.local_prefill_tokens,
            "hit_threshold": tb.hit_threshold,
            "relay_busy_requests": tb.relay_busy_requests,
            "md_max_batched_tokens": tb.md_max_batched_tokens,
            "wan_mbps": tb.wan_mbps,
            "wan_delay_ms": tb.wan_delay_ms,
            "pipeline_policy": router.pipeline_policy,
            "ttft_budget_s": router.ttft_budget_s,
            "ttft_budget_ratio": router.ttft_budget_ratio,
        },
        "results": results,
    }


def testbed_config(d: dict, profile: str) -> SimConfig:
    tb = d["testbed"]
    return SimConfig(
        profile=profile,
        prefill_instances=tb["prefill"],
        idc_prefill_instances=tb["prefill"],
        relay_instances=tb["relay"],
        md_instances=tb["main_decode"],
        idc_decode_instances=tb["main_decode"],
        prefill_chip="cpu",
        relay_chip="cpu",
        md_chip="cpu",
        idc_decode_chip="cpu",
        md_chunk_tokens=tb["md_max_batched_tokens"],
        hit_threshold=tb["hit_threshold"],
        local_prefill_tokens=tb["local_prefill_tokens"],
        relay_busy_requests=tb["relay_busy_requests"],
        # NOTE: a run recorded before router v2 (no field) was routed by θ
        pipeline_policy=tb.get("pipeline_policy", "threshold"),
        ttft_budget_s=tb.get("ttft_budget_s", 0.5),
        # NOTE: one recorded before the budget scaled with TTFT held the absolute one
        ttft_budget_ratio=tb.get("ttft_budget_ratio", 0.0),
        sla_p90_s=1.0,
        sla_p99_s=1e9,
    )


def validate(
    recorded: str | Path = RECORDED, profile: str = "testbed", profile_obj: Profile | None = None
) -> list[dict]:
    """One row per (mode, metric): recorded, simulated, relative error, within tolerance."""
    d = json.loads(Path(recorded).read_text())
    reqs = recorded_requests(d)
    cfg, prof = testbed_config(d, profile), profile_obj or load_profile(profile)
    rows = []
    for mode in MODES:
        cfg_m = cfg if mode == "pdd" else _no_local(cfg)
        if mode == "idc-pd":  # the unshaped link: full speed, no delay
            cfg_m = _unshaped(cfg_m)
        sim = simulate(cfg_m, mode, requests=reqs, profile=prof)
        rec = d["results"][mode]
        for metric, want, got in (
            ("TTFDT P50 ms", rec["ttfdt_ms"]["p50"], sim["ttft_s"]["p50"] * 1e3),
            ("TTFDT P90 ms", rec["ttfdt_ms"]["p90"], sim["ttft_s"]["p90"] * 1e3),
            ("RLD share %", 100 * rec["rld_token_share"], 100 * sim["rld_token_share"]),
        ):
            err = (got - want) / want if want else (0.0 if not got else float("inf"))
            rows.append(
                {
                    "mode": mode,
                    "metric": metric,
                    "recorded": want,
                    "simulated": got,
                    "error": err,
                    "ok": abs(err) <= TOLERANCE,
                }
            )
    return rows


def _no_local(cfg: SimConfig) -> SimConfig:
    from dataclasses import replace

    return replace(cfg, local_prefill_tokens=0)


def _unshaped(cfg: SimConfig) -> SimConfig:
    from dataclasses import replace

    return replace(cfg, wan_gbps=1e3, wan_delay_ms=0.0)


def table(rows: list[dict]) -> str:
    head = f"{'mode':<7} {'metric':<13} {'recorded':>9} {'simulated':>9} {'error':>7}  within {TOLERANCE:.0%}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<7} {r['metric']:<13} {r['recorded']:>9.1f} {r['simulated']:>9.1f} "
            f"{r['error']:>+7.0%}  {'yes' if r['ok'] else 'NO'}"
        )
    return "\n".join(lines)
