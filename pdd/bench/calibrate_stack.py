"""What the serving stack itself costs, beyond the engine: ``pdd bench calibrate --stack``.

The engine's fit (``calibrate.measure_engine``) times bare forward passes in one process. A served
request also pays the stack: per request, the gateway, kvstore's prediction and the gRPC hops
before a stage computes (``measure_stack``); per token, the decoding process's serving loop (the
engine thread hands each step's tokens to the event loop, one gRPC message per token) and, on the
testbed, the processes that share its core — the relay shares the main cluster's CPU with the
gateway and the bench client, which handle every token it streams, and with prefill; MainDecode
shares the remote CPU with the WAN emulator that forwards its tokens (``measure_stream``). Both
are measured on the pinned testbed stack, as ``pdd bench`` runs it, and each number's source says
how and under what host load.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from pdd.bench.sim_profile import ChipProfile
from pdd.bench.trace import TraceRequest


def _engine(chip: dict) -> ChipProfile:
    """The fitted chip (``calibrate.measure_engine``'s numbers, sources dropped) as the
    simulator computes with it."""
    return ChipProfile(**{k: val for k, (val, _) in chip.items()})


def _run(trace: list[TraceRequest], mode: str, testbed):
    """The run's outcome: ``records`` and ``result`` (with ``cpu``: each process's cores used),
    and what prefill logged of each request it served (``prefilled``: tokens, cached, ms)."""
    from pdd.bench.runner import run_mode  # NOTE: lazy: starts processes, imports grpc

    with tempfile.TemporaryDirectory() as d:
        outcome = run_mode(trace, mode, Path(d) / f"{mode}.json", testbed=testbed)
        logs = outcome.log_dir
        return outcome, prefills(logs / "prefill-0.log") if logs else []


def prefills(log: Path) -> list[dict]:
    """The ``prefilled`` events of a prefill service's JSON log (warm-up requests left out)."""
    out = []
    if not log.is_file():
        return out
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "prefilled" and not str(e.get("request_id", "")).startswith("warm"):
            out.append(e)
    return out


def prefill_factor(events: list[dict], chip: dict) -> float:
    """Median of each served prefill's ms ÷ what the engine fit computes for its tokens."""
    v = _engine(chip)
    ratios = []
    for e in events:
        c = e["cached_tokens"]
        k = e["prompt_tokens"] - c
        if k > 0:
            ratios.append(e["prefill_ms"] / (v.prefill_overhead_ms + v.prefill_ms(k, c)))
    if not ratios:
        raise RuntimeError("calibrate --stack: prefill logged no request it computed")
    return float(np.median(ratios))


def _load() -> str:
    return f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"


def measure_stack(
    testbed,
    chip: dict,
    mode: str = "idc-pd",
    *,
    requests: int = 12,
    prompt_tokens: int = 64,
    gap_ms: float = 400.0,
) -> tuple[float, str]:
    """The serving stack's own cost per request: the testbed stack (pinned as the bench runs it)
    serves ``requests`` tiny one-turn requests one at a time; their median TTFDT less what the
    fitted chip says the engines compute. ``idc-pd``: pipeline P-MD on the unshaped link (a prefill
    of ``prompt_tokens``, one decode step); ``pdd``: the router's local prefill sends them down
    pipeline MD (MainDecode computes them in one step; the WAN's delay each way is the sim's)."""
    rng = random.Random(1)
    trace = [
        TraceRequest(
            request_id=f"cal{i}",
            session_id=f"cal{i}",
            timestamp_ms=i * gap_ms,
            prompt_token_ids=[rng.randrange(10, 4000) for _ in range(prompt_tokens)],
            max_tokens=4,
            expected_hit=0.0,
        )
        for i in range(requests)
    ]
    records = _run(trace, mode, testbed)[0].records
    want = "p-md" if mode == "idc-pd" else "md"
    ttfdt = [r.ttfdt_ms for r in records if r.ok and r.pipeline == want and r.ttfdt_ms]
    if len(ttfdt) < requests // 2:
        raise RuntimeError(f"calibrate --stack: only {len(ttfdt)}/{requests} requests served")
    v = _engine(chip)
    n = prompt_tokens
    step = v.decode_ms(1, 0)
    if want == "p-md":
        compute = v.prefill_overhead_ms + v.prefill_ms(n, 0) + step
    else:
        compute = step + v.extend_chunk_ms(n, 0) + 2 * testbed.wan_delay_ms
    med = float(np.median(ttfdt))
    how = (
        f"measured by `pdd bench calibrate --stack`, {time.strftime('%Y-%m-%d')}: {len(ttfdt)} "
        f"idle {n}-token {mode} requests (pipeline {want}) through the pinned testbed stack, TTFDT P50 "
        f"{med:.1f} ms (P10-P90 {np.percentile(ttfdt, 10):.1f}-{np.percentile(ttfdt, 90):.1f}) "
        f"less the {compute:.1f} ms the simulator computes for them; {_load()}"
    )
    return max(0.0, med - compute), how


def cpu_ms_per_token(result: dict, records) -> dict[str, float]:
    """CPU time per streamed token of each decoding stage and of what forwards its tokens, from
    the run's ``cpu`` (user + system time per process: unlike wall time, not stretched by other
    work on the host). ``relay`` / ``main_decode``: the process's CPU over the tokens it produced;
    ``main_side``: the gateway and the bench client over every token (the relay's core runs them);
    ``wan``: the WAN emulator over every token (MainDecode's core runs it)."""
    cpu = result["cpu"]
    wall, procs = cpu["wall_s"], cpu["services"]
    rld = sum(r.rld_tokens for r in records if r.ok)
    md = sum(r.md_tokens for r in records if r.ok)
    every = rld + md
    per = lambda name, n: 1e3 * procs.get(name, 0.0) * wall / n if n else 0.0  # noqa: E731
    return {
        "relay": per("relay-0", rld),
        "main_decode": per("main_decode-0", md),
        "main_side": per("gateway", every) + per("bench_client", every),
        "wan": per("wan-0", every),
    }


def measure_stream(
    testbed,
    chip: dict,
    *,
    requests: int = 8,
    md_prompt_tokens: int = 64,
    md_output_tokens: int = 64,
    relay_prompt_tokens: int = 1536,
    relay_output_tokens: int = 256,
    gap_ms: float = 1500.0,
) -> dict[str, tuple[float, str]]:
    """The stack's cost per decode step of each stage (batch 1), beyond the engine's step.

    One PDD stack serves, one at a time, ``requests`` short fresh prompts that the router sends
    down pipeline MD (MainDecode decodes them) and as many long fresh ones it sends down P-RLD-MD
    (the relay decodes until MainDecode holds their KV: a 1536-token delta takes ~0.6 s of the
    80 Mbps WAN, past the link-aware router's 0.5 s budget for P-MD). Per stage: its process's CPU
    per token plus what the processes on its core spend forwarding it (``cpu_ms_per_token``), less
    the engine fit's batch-1 step. CPU time, not wall time: on a shared host the wall time per
    token also holds other tenants' work, which is the host's state, not the stack's cost.
    """
    rng = random.Random(2)
    ids = lambda n: [rng.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    trace = []
    for i in range(2 * requests):
        relay = i % 2 == 1
        trace.append(
            TraceRequest(
                request_id=f"str{i}",
                session_id=f"str{i}",
                timestamp_ms=i * gap_ms,
                prompt_token_ids=ids(relay_prompt_tokens if relay else md_prompt_tokens),
                max_tokens=relay_output_tokens if relay else md_output_tokens,
                expected_hit=0.0,
            )
        )
    run, _ = _run(trace, "pdd", testbed)
    records = [r for r in run.records if r.ok]
    if not any(r.rld_tokens for r in records):
        raise RuntimeError("calibrate --stack: no request was decoded on the relay")
    per = cpu_ms_per_token(run.result, records)
    step = _engine(chip).decode_ms(1, 0)
    pipelines = {p: sum(r.pipeline == p for r in records) for p in ("md", "p-md", "p-rld-md")}
    how = (
        f"measured by `pdd bench calibrate --stack`, {time.strftime('%Y-%m-%d')}: one pinned PDD "
        f"testbed stack serving {len(records)} idle requests one at a time ({pipelines}); CPU per "
        f"token (ms) relay {per['relay']:.2f}, MainDecode {per['main_decode']:.2f}, gateway + "
        f"bench client {per['main_side']:.2f}, WAN emulator {per['wan']:.2f}; less the engine "
        f"fit's batch-1 step {step:.2f} ms; {_load()} (CPU time is not stretched by it)"
    )
    relay = per["relay"] + per["main_side"] - step
    md = per["main_decode"] + per["wan"] - step
    return {
        "relay_stream_ms_per_step": (max(0.0, relay), f"{how}: relay + gateway + client"),
        "md_stream_ms_per_step": (max(0.0, md), f"{how}: MainDecode + WAN emulator"),
    }


def measure_prefill(testbed, chip: dict, *, sessions: int = 4, seed: int = 7) -> tuple[float, str]:
    """A served prefill's time ÷ the bare engine's for the same tokens, on the workload's shape.

    The bench's agentic trace (``pdd demo``'s quick shape, its own seed: sessions whose turns
    embed the previous output, so prefill computes a suffix after a cached prefix, several
    sessions at once) through the pinned IDC-PD stack; per request prefill's own ``prefilled``
    log (from admission to its last chunk: KV export and the stage's hops included) against what
    the engine fit computes for its (cached, new) tokens. Fresh one-at-a-time prompts say less:
    what the stage adds grows with the cached prefix and with the requests beside it.
    """
    from pdd.bench.demo import PRESETS
    from pdd.bench.trace import TraceConfig, generate

    cfg = TraceConfig(
        sessions=sessions,
        turns=4,
        rps=2.0,
        seed=seed,
        prompt_tokens=1024,
        # NOTE: the testbed model's context, as `pdd demo` has it: the default (8192) made
        # sessions whose later turns the stack refused (INVALID_ARGUMENT), 3 of 16 prefills.
        max_context_tokens=PRESETS["quick"].max_context_tokens,
        vocab_high=4096,
        concurrent_sessions=2,
    )
    _, served = _run(generate(cfg), "idc-pd", testbed)
    factor = prefill_factor(served, chip)
    how = (
        f"measured by `pdd bench calibrate --stack`, {time.strftime('%Y-%m-%d')}: {len(served)} "
        f"prefills of a {sessions}-session agentic trace (seed {seed}) through the pinned IDC-PD "
        f"stack, prefill's `prefilled` log (ms from admission to the last chunk, KV export "
        f"included), median of each ÷ the engine fit's ms for its tokens; {_load()}"
    )
    return max(1.0, factor), how


def median_of(runs: list[dict[str, tuple[float, str]]]) -> dict[str, tuple[float, str]]:
    """Each number as the median of ``runs`` (the stack's figures move run to run on a shared
    host, and the replay is as sensitive to them as to the model): the median run's source, with
    every run's value."""
    if len(runs) == 1:
        return runs[0]
    out = {}
    for key in runs[0]:
        values = [r[key][0] for r in runs]
        mid = sorted(range(len(runs)), key=lambda i: values[i])[len(runs) // 2]
        spread = ", ".join(f"{v:.3g}" for v in values)
        out[key] = (
            values[mid],
            f"median of {len(runs)} runs ({spread}); that run: {runs[mid][key][1]}",
        )
    return out
