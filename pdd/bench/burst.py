"""``pdd bench burst``: the stack's capacity, then a burst of N× that, and how it degrades.

Life of a run (against a running gateway, e.g. ``pdd up``, or ``--own-stack``: one it starts,
``burst_stack``):
  1. capacity: ``--concurrency`` clients (16) issue requests back to back for ``--capacity-s``;
     completed/s is the capacity, and the TTFT of those requests the reference distribution;
  2. burst: seeded Poisson arrivals at ``--factor`` × capacity (5×) for ``--duration-s`` (60 s),
     each request with the client deadline ``--deadline-s`` (8 s);
  3. the report: completed/s during the burst against capacity (goodput: completions of the
     burst's requests over the burst's length), how many were refused (RESOURCE_EXHAUSTED) and
     how fast, how many ran into their deadline (hung), other errors, and the TTFT P50/P90 of
     the accepted requests against those at capacity;
  4. the verdict (``burst_checks``; with an own stack also: no process died, nothing held once
     drained); exit status 1 when a check fails. ``--out`` keeps the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from pdd.bench.burst_checks import BurstBar, burst_checks
from pdd.bench.soak_samples import render_checks
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.server.tls import TlsConfig, open_channel
from pdd.testbed.stack import check_model

REFUSED, DEADLINE, COMPLETED = "refused", "deadline", "completed"


@dataclass(frozen=True)
class BurstConfig:
    gateway: str = "127.0.0.1:50050"
    concurrency: int = 16
    capacity_s: float = 10.0
    factor: float = 5.0
    duration_s: float = 60.0
    deadline_s: float = 8.0
    max_tokens: int = 96
    # Prompt lengths drawn uniformly from [min, max] tokens; ids from [1, vocab).
    prompt_tokens: tuple[int, int] = (16, 64)
    vocab: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_tokens", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("capacity_s", "factor", "duration_s", "deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        lo, hi = self.prompt_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_tokens: need 1 <= min <= max, got {self.prompt_tokens}")


@dataclass(frozen=True)
class Outcome:
    """One request: how it ended, when it started (s from its phase's start), its TTFT and how
    long until its end (completion, refusal or error)."""

    status: str  # completed | refused | deadline | a gRPC code name
    start_s: float
    end_s: float
    ttft_s: float | None
    request_id: str = ""
    # The TTFT the gateway measured (its final stats): the stack's, without this client's lag.
    gateway_ttft_s: float | None = None


async def _request(stub, prompt: list[int], cfg: BurstConfig, rid: str, t0: float) -> Outcome:
    request = pb.GenerateRequest(max_tokens=cfg.max_tokens, ignore_eos=True, request_id=rid)
    request.prompt_token_ids.token_ids.extend(prompt)
    start = time.monotonic()
    ttft = gateway_ttft = None
    try:
        async for resp in stub.Generate(request, timeout=cfg.deadline_s):
            if ttft is None and resp.token_ids:
                ttft = time.monotonic() - start
            if resp.HasField("stats") and resp.stats.ttft_ms > 0:
                gateway_ttft = resp.stats.ttft_ms / 1000
        status = COMPLETED
    except grpc.aio.AioRpcError as exc:
        status = {
            grpc.StatusCode.RESOURCE_EXHAUSTED: REFUSED,
            grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE,
        }.get(exc.code(), exc.code().name)
    return Outcome(status, start - t0, time.monotonic() - t0, ttft, rid, gateway_ttft)


def _prompt(rng: random.Random, cfg: BurstConfig) -> list[int]:
    lo, hi = cfg.prompt_tokens
    return [rng.randrange(1, cfg.vocab) for _ in range(rng.randint(lo, hi))]


async def capacity_phase(stub, cfg: BurstConfig, rng: random.Random) -> list[Outcome]:
    """``concurrency`` closed-loop clients for ``capacity_s``."""
    t0 = time.monotonic()
    out: list[Outcome] = []

    async def client(k: int) -> None:
        i = 0
        while time.monotonic() - t0 < cfg.capacity_s:
            out.append(await _request(stub, _prompt(rng, cfg), cfg, f"cap-{k}-{i}", t0))
            i += 1

    await asyncio.gather(*(client(k) for k in range(cfg.concurrency)))
    return out


async def loop_lag(lags: list[float], stop: asyncio.Event, every_s: float = 0.05) -> None:
    """How late this process's own event loop wakes (s, appended to ``lags``): the part of every
    latency the client measures that is the client's, not the stack's."""
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(every_s)
        lags.append(max(0.0, time.monotonic() - t - every_s))


async def burst_phase(
    stub,
    cfg: BurstConfig,
    rate: float,
    rng: random.Random,
    lags: list[float] | None = None,
    t0: float | None = None,
) -> list[Outcome]:
    """Poisson arrivals at ``rate`` per second for ``duration_s`` from ``t0`` (monotonic; now);
    every request awaited."""
    t0 = time.monotonic() if t0 is None else t0
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()
    monitor = asyncio.create_task(loop_lag(lags if lags is not None else [], stop))
    at = 0.0
    while (at := at + rng.expovariate(rate)) < cfg.duration_s:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        prompt = _prompt(rng, cfg)
        tasks.append(asyncio.create_task(_request(stub, prompt, cfg, f"burst-{len(tasks)}", t0)))
    out = list(await asyncio.gather(*tasks))
    stop.set()
    await monitor
    return out


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def timeline(burst: Sequence[Outcome], bin_s: float = 5.0) -> list[dict]:
    """Per ``bin_s`` of the burst (by arrival): offered, completed, refused, and the TTFT P50 of
    the accepted and refusal P50 there — how the gateway's bound settles."""
    bins: dict[int, list[Outcome]] = {}
    for o in burst:
        bins.setdefault(int(o.start_s // bin_s), []).append(o)
    rows = []
    for k in sorted(bins):
        os_ = bins[k]
        done = [o for o in os_ if o.status == COMPLETED]
        refused = [o.end_s - o.start_s for o in os_ if o.status == REFUSED]
        rows.append(
            {
                "t_s": k * bin_s,
                "offered": len(os_),
                "completed": len(done),
                "refused": len(refused),
                "ttft_ms_p50": _pct([o.ttft_s for o in done if o.ttft_s is not None], 50),
                "refusal_ms_p50": _pct(refused, 50),
            }
        )
    return rows


def _p50_p90(xs: Sequence[float | None]) -> dict:
    got = [x for x in xs if x is not None]
    return {"p50": _pct(got, 50), "p90": _pct(got, 90)}


def report(cfg: BurstConfig, cap: list[Outcome], burst: list[Outcome]) -> dict:
    """The run's numbers (times in ms)."""
    cap_done = [o for o in cap if o.status == COMPLETED]
    capacity = len(cap_done) / cfg.capacity_s
    done = [o for o in burst if o.status == COMPLETED]
    refused = [o for o in burst if o.status == REFUSED]
    cap_ttft = [o.ttft_s for o in cap_done if o.ttft_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    goodput = len(done) / cfg.duration_s
    return {
        "config": asdict(cfg),
        "capacity_rps": round(capacity, 2),
        "capacity_errors": dict(Counter(o.status for o in cap if o.status != COMPLETED)),
        "offered_rps": round(len(burst) / cfg.duration_s, 2),
        "offered": len(burst),
        "completed": len(done),
        "completed_rps": round(goodput, 2),
        "goodput_vs_capacity": round(goodput / capacity, 3) if capacity else None,
        "refused": len(refused),
        "refusal_ms_p50": _pct([o.end_s - o.start_s for o in refused], 50),
        "refusal_ms_max": _pct([o.end_s - o.start_s for o in refused], 100),
        "hung_past_deadline": sum(o.status == DEADLINE for o in burst),
        "other_errors": dict(
            Counter(o.status for o in burst if o.status not in (COMPLETED, REFUSED, DEADLINE))
        ),
        "ttft_ms_at_capacity": {"p50": _pct(cap_ttft, 50), "p90": _pct(cap_ttft, 90)},
        "ttft_ms_accepted_in_burst": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90)},
        "gateway_ttft_ms_at_capacity": _p50_p90([o.gateway_ttft_s for o in cap_done]),
        "gateway_ttft_ms_accepted_in_burst": _p50_p90([o.gateway_ttft_s for o in done]),
        "timeline": timeline(burst),
        "request_ids": [o.request_id for o in (*cap, *burst)],
        # Each of the burst's requests: status, start and end (s into the burst), TTFT (s).
        "burst_outcomes": [
            [o.status, round(o.start_s, 4), round(o.end_s, 4), o.ttft_s and round(o.ttft_s, 4)]
            for o in burst
        ],
    }


async def run_burst(cfg: BurstConfig, tls: TlsConfig = TlsConfig()) -> dict:
    rng = random.Random(cfg.seed)
    async with open_channel(cfg.gateway, tls) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        print(f"capacity: {cfg.concurrency} concurrent for {cfg.capacity_s:g} s", file=sys.stderr)
        cap = await capacity_phase(stub, cfg, rng)
        capacity = sum(o.status == COMPLETED for o in cap) / cfg.capacity_s
        if capacity <= 0:
            raise RuntimeError(
                f"no request completed at capacity: {Counter(o.status for o in cap)}"
            )
        rate = cfg.factor * capacity
        print(
            f"burst: {rate:.1f} req/s ({cfg.factor:g}x {capacity:.1f}) for {cfg.duration_s:g} s",
            file=sys.stderr,
        )
        lags: list[float] = []
        t0 = time.monotonic()
        burst = await burst_phase(stub, cfg, rate, rng, lags, t0)
    out = report(cfg, cap, burst)
    out["burst_t0_monotonic"] = t0
    out["client_loop_lag_ms"] = {
        "p50": _pct(lags, 50),
        "p99": _pct(lags, 99),
        "max": _pct(lags, 100),
    }
    return out


def _render(r: dict) -> str:
    rows = [
        ("capacity (16 concurrent)", f"{r['capacity_rps']} completed/s"),
        ("offered in the burst", f"{r['offered_rps']} req/s, {r['offered']} requests"),
        (
            "completed in the burst",
            f"{r['completed_rps']}/s = {r['goodput_vs_capacity']} x capacity",
        ),
        (
            "refused (RESOURCE_EXHAUSTED)",
            f"{r['refused']}, P50 {r['refusal_ms_p50']} ms, max {r['refusal_ms_max']} ms",
        ),
        ("hung past the deadline", str(r["hung_past_deadline"])),
        ("other errors", json.dumps(r["other_errors"])),
        ("TTFT at capacity P50/P90", "{p50} / {p90} ms".format(**r["ttft_ms_at_capacity"])),
        (
            "TTFT accepted in burst P50/P90",
            "{p50} / {p90} ms".format(**r["ttft_ms_accepted_in_burst"]),
        ),
        (
            "  as the gateway measured",
            "at capacity {} / {} ms, in burst {} / {} ms".format(
                *r["gateway_ttft_ms_at_capacity"].values(),
                *r["gateway_ttft_ms_accepted_in_burst"].values(),
            ),
        ),
    ]
    if lag := r.get("client_loop_lag_ms"):
        rows.append(
            ("this client's loop late by", "P50 {p50} / P99 {p99} / max {max} ms".format(**lag))
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench burst --gateway HOST:PORT [--factor 5] [--duration-s 20] [--out R.json]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["burst"]:
        argv = argv[1:]
    d = BurstConfig()
    p = argparse.ArgumentParser(prog="pdd bench burst", description=__doc__.split("\n")[0])
    p.add_argument("--gateway", default=d.gateway, help="gateway host:port")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="clients at capacity")
    p.add_argument("--capacity-s", type=float, default=d.capacity_s, help="capacity phase length")
    p.add_argument("--factor", type=float, default=d.factor, help="burst rate / capacity")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="burst length")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s, help="each request's deadline")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens each")
    p.add_argument("--vocab", type=int, default=d.vocab, help="prompt token ids from [1, vocab)")
    p.add_argument("--seed", type=int, default=d.seed, help="prompts and arrivals")
    p.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    own = p.add_argument_group("own stack (--own-stack: start one, burst it, judge it)")
    own.add_argument("--own-stack", action="store_true", help="start a stack instead of --gateway")
    own.add_argument("--model", default="tiny:7,ctx=512", help="the own stack's model")
    own.add_argument("--log-dir", type=Path, default=Path("pdd-burst/logs"), help="its logs")
    own.add_argument(
        "--gateway-flag",
        action="append",
        default=[],
        help="one more flag for its gateway, e.g. --gateway-flag=--admission-wait-s=0 (repeatable)",
    )
    bar = p.add_argument_group("the verdict's bar")
    bar.add_argument("--goodput", type=float, default=0.9, help="completed/s ÷ capacity, at least")
    bar.add_argument("--refusal-s", type=float, default=1.0, help="slowest refusal, at most")
    bar.add_argument("--ttft-factor", type=float, default=2.0, help="accepted TTFT ÷ capacity's")
    a = p.parse_args(argv)
    try:
        cfg = BurstConfig(
            a.gateway,
            a.concurrency,
            a.capacity_s,
            a.factor,
            a.duration_s,
            a.deadline_s,
            a.max_tokens,
            vocab=a.vocab,
            seed=a.seed,
        )
        verdict_bar = BurstBar(a.goodput, a.refusal_s, a.ttft_factor)
        if a.own_stack:
            # NOTE: here, not at the top: burst_stack builds on this module
            from pdd.bench.burst_stack import OwnStack, run_own_stack

            own_cfg = OwnStack(
                model=a.model, log_dir=a.log_dir, gateway_flags=tuple(a.gateway_flag)
            )
            check_model(a.model)
    except ValueError as exc:
        p.error(str(exc))
    if a.own_stack:
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        result, checks = run_own_stack(cfg, own_cfg, verdict_bar, say=say)
    else:
        result = asyncio.run(run_burst(cfg))
        checks = burst_checks(result, bar=verdict_bar)
    print(_render(result))
    print(render_checks(checks))
    result["checks"] = [asdict(c) for c in checks]
    result["ok"] = all(c.ok for c in checks)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
