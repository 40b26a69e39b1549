"""``pdd bench soak`` (``make soak``): a steady load for a long time, and whether anything leaks.

Life of a run:
  1. start one Stack (its own Redis, every service with /metrics, a tiny model);
  2. capacity: ``--concurrency`` closed-loop clients for ``--capacity-s``; the soak's rate is
     ``--load`` × that (70 %); then, drained, every process is sampled idle — the baseline, with
     the channels each role opens to its peers under load already open: resident memory and open
     descriptors from /proc, the leak gauges from /metrics (``soak_samples``);
  3. the soak: seeded Poisson arrivals for ``--duration-s`` (20 min), each a turn of a session
     (its prompt is the session's history — earlier prompts and outputs — plus new tokens, so the
     prefix caches and the index work as in production), ``--cancel-fraction`` (10 %) of them
     cancelled by the client mid-stream; at half time the relay is restarted (SIGTERM, started
     again on its address); every ``--sample-s`` (10 s) each process is sampled;
  4. drain, sample idle again (three samples a second apart: a periodic task is in some, a
     leak in all), ask every engine instance whether it still holds any of the
     soak's requests, and judge (``soak_samples.verdict``): no error but the cancellations, RSS
     growth after warm-up within ``--rss-growth`` (5 %), no growth in descriptors or asyncio
     tasks, no request, KV or fast-link region held. The numbers go to ``--out`` as soak.json and
     the plot as soak.svg. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from pdd.bench.engine_probe import EngineProbe
from pdd.bench.soak_plot import render
from pdd.bench.soak_samples import (
    Check,
    Sample,
    read_process,
    render_checks,
    scrape_metrics,
    verdict,
)
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.testbed.stack import LinkSettings, Stack, StackConfig

COMPLETED, CANCELLED = "completed", "cancelled"
# Seconds the stack is left idle before the baseline and after the load (leases, deferred frees,
# the last cache events), and the samples taken idle at the end (judged by their least).
IDLE_DRAIN_S = 3.0
IDLE_SAMPLES = 3


@dataclass(frozen=True)
class SoakConfig:
    out: Path = Path("pdd-soak")
    duration_s: float = 1200.0
    # Samples before this many seconds of load are not judged (the first allocations, the caches
    # filling, the high-water marks of the load's peak concurrency); a restarted process gets the
    # same warm-up from its restart on. NOTE: 7 min, measured: in a 20-min run MainDecode's RSS,
    # prefill's kept shm mappings and kvstore's Redis connections grew until ~6 min (the load's
    # peak) and not by a byte or a descriptor in the 14 min after; with 3 min they were flagged.
    warmup_s: float = 420.0
    sample_s: float = 10.0
    load: float = 0.7
    concurrency: int = 8
    capacity_s: float = 20.0
    cancel_fraction: float = 0.1
    sessions: int = 24
    # New tokens per turn, and the history at which a session starts over.
    turn_tokens: tuple[int, int] = (16, 64)
    max_history: int = 640
    max_tokens: tuple[int, int] = (16, 64)
    request_timeout_s: float = 60.0
    # Restart the relay at half time ("" = no restart).
    restart: str = "relay-0"
    rss_growth: float = 0.05
    model: str = "tiny:7,ctx=1024"
    wan_delay_ms: float = 20.0
    seed: int = 0
    # Extra flags for every engine service.
    # A small KV pool (4K blocks of the tiny model), so the caches reach their LRU steady state
    # within the warm-up: resident memory is judged once they no longer grow by design.
    engine_flags: tuple[str, ...] = field(default=("--threads", "1", "--kv-cache-mb", "32"))

    def __post_init__(self) -> None:
        for name in ("duration_s", "sample_s", "capacity_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s: must be in [0, duration_s), got {self.warmup_s}")
        if not 0 < self.load <= 1:
            raise ValueError(f"load: must be in (0, 1], got {self.load}")
        if not 0 <= self.cancel_fraction < 1:
            raise ValueError(f"cancel_fraction: must be in [0, 1), got {self.cancel_fraction}")
        for name in ("concurrency", "sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("turn_tokens", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got {lo}..{hi}")
        if self.max_history < self.turn_tokens[1]:
            raise ValueError(f"max_history: must be >= the longest turn ({self.turn_tokens[1]})")
        if self.rss_growth <= 0:
            raise ValueError(f"rss_growth: must be > 0, got {self.rss_growth}")
        if self.restart and not self.restart.startswith(("relay-", "prefill-", "main_decode-")):
            raise ValueError(
                f"restart: an engine service's name (relay-0, ...), got {self.restart!r}"
            )


def stack_config(cfg: SoakConfig) -> StackConfig:
    return StackConfig(
        model=cfg.model,
        gateway_port=0,
        metrics=True,
        prefill=1,
        relay=1,
        main_decode=1,
        wan=LinkSettings(delay_ms=cfg.wan_delay_ms),
        engine_flags=cfg.engine_flags,
        gateway_flags=("--seed", str(cfg.seed)),
        log_dir=cfg.out / "logs",
        key_prefix=f"soak{uuid.uuid4().hex[:8]}",
    )


class Session:
    """One conversation: the tokens so far; a turn adds new tokens, then the reply."""

    def __init__(self, rng: random.Random, cfg: SoakConfig) -> None:
        self.rng, self.cfg = rng, cfg
        self.history: list[int] = []
        self.busy = False

    def next_prompt(self) -> list[int]:
        lo, hi = self.cfg.turn_tokens
        new = [self.rng.randrange(1, 250) for _ in range(self.rng.randint(lo, hi))]
        if len(self.history) + len(new) + self.cfg.max_tokens[1] > self.cfg.max_history:
            self.history = []  # NOTE: the session starts over; its old prefix ages out of caches
        return self.history + new

    def record(self, prompt: list[int], reply: list[int]) -> None:
        self.history = prompt + reply


@dataclass
class Outcome:
    status: str
    tokens: int


async def one_turn(
    stub, session: Session, rid: str, max_tokens: int, cancel_after: int | None, timeout: float
) -> Outcome:
    prompt = session.next_prompt()
    request = pb.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, request_id=rid)
    request.prompt_token_ids.token_ids.extend(prompt)
    reply: list[int] = []
    call = stub.Generate(request, timeout=timeout)
    try:
        async for resp in call:
            reply.extend(resp.token_ids)
            if cancel_after is not None and len(reply) >= cancel_after:
                call.cancel()
                return Outcome(CANCELLED, len(reply))
        status = COMPLETED if len(reply) == max_tokens else f"short_{len(reply)}_of_{max_tokens}"
    except grpc.aio.AioRpcError as exc:
        status = exc.code().name
    if status == COMPLETED:
        session.record(prompt, reply)
    return Outcome(status, len(reply))


class Soak:
    def __init__(self, cfg: SoakConfig, stack: Stack, say=print) -> None:
        self.cfg, self.stack, self.say = cfg, stack, say
        self.rng = random.Random(cfg.seed)
        self.samples: list[Sample] = []
        self.outcomes: Counter[str] = Counter()
        self.request_ids: list[str] = []
        self.restarts: list[float] = []
        # A restarted process → when it listened again.
        self.back: dict[str, float] = {}
        self.t0 = time.monotonic()

    async def sample(self, t_s: float | None = None) -> None:
        t = time.monotonic() - self.t0 if t_s is None else t_s
        for p in list(self.stack.processes):
            if not p.alive():
                continue
            rss, fds, kinds = read_process(p.proc.pid)
            gauges = await asyncio.to_thread(scrape_metrics, self.stack.metrics.get(p.name, ""))
            self.samples.append(Sample(round(t, 2), p.name, p.proc.pid, rss, fds, gauges, kinds))

    async def _sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.sample_s)
            except TimeoutError:
                pass

    def _turn_args(self) -> tuple[int, int | None]:
        n = self.rng.randint(*self.cfg.max_tokens)
        cancel = (
            self.rng.randint(1, max(1, n - 1))
            if self.rng.random() < self.cfg.cancel_fraction
            else None
        )
        return n, cancel

    async def capacity(self, stub) -> float:
        sessions = [
            Session(random.Random(self.rng.random()), self.cfg) for _ in range(self.cfg.concurrency)
        ]
        t0 = time.monotonic()
        done = 0

        async def client(k: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() - t0 < self.cfg.capacity_s:
                n = self.rng.randint(*self.cfg.max_tokens)
                o = await one_turn(
                    stub, sessions[k], f"soak-cap-{k}-{i}", n, None, self.cfg.request_timeout_s
                )
                done += o.status == COMPLETED
                i += 1

        await asyncio.gather(*(client(k) for k in range(self.cfg.concurrency)))
        return done / (time.monotonic() - t0)

    async def _restart_at(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + at_s - time.monotonic()))
        self.say(f"restarting {self.cfg.restart} at {at_s:.0f} s")
        self.restarts.append(round(time.monotonic() - self.t0, 2))
        new = await asyncio.to_thread(self.stack.restart, self.cfg.restart)
        await asyncio.to_thread(new.wait_listening, 120)
        self.back[self.cfg.restart] = round(time.monotonic() - self.t0, 2)
        self.say(f"{self.cfg.restart} is back ({new.address})")

    async def load(self, stub, rate: float) -> None:
        sessions = [
            Session(random.Random(self.rng.random()), self.cfg) for _ in range(self.cfg.sessions)
        ]
        tasks: list[asyncio.Task] = []

        async def run(session: Session, rid: str) -> None:
            n, cancel = self._turn_args()
            try:
                o = await one_turn(stub, session, rid, n, cancel, self.cfg.request_timeout_s)
            finally:
                session.busy = False
            self.outcomes[o.status] += 1
            if o.status not in (COMPLETED, CANCELLED):
                self.say(f"request {rid}: {o.status}")

        at = 0.0
        while (at := at + self.rng.expovariate(rate)) < self.cfg.duration_s:
            await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
            idle = [s for s in sessions if not s.busy]
            session = (
                self.rng.choice(idle)
                if idle
                else Session(random.Random(self.rng.random()), self.cfg)
            )
            session.busy = True
            rid = f"soak-{len(self.request_ids)}"
            self.request_ids.append(rid)
            tasks.append(asyncio.create_task(run(session, rid)))
            tasks = [t for t in tasks if not t.done()]
        await asyncio.gather(*tasks)

    async def run(self) -> dict:
        cfg = self.cfg
        async with grpc.aio.insecure_channel(self.stack.gateway.address) as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            await one_turn(
                stub, Session(self.rng, cfg), "soak-warm", 4, None, cfg.request_timeout_s
            )
            self.say(f"capacity: {cfg.concurrency} concurrent for {cfg.capacity_s:g} s")
            capacity = await self.capacity(stub)
            if capacity <= 0:
                raise RuntimeError("no request completed while measuring capacity")
            # NOTE: the idle baseline after the capacity run, drained: the channels every role
            # opens to its peers under load (and their tasks) are open from here on, not a leak.
            await asyncio.sleep(IDLE_DRAIN_S)
            await self.sample(t_s=-1.0)
            rate = cfg.load * capacity
            self.say(
                f"soak: {rate:.2f} req/s ({cfg.load:g} x {capacity:.2f}) for {cfg.duration_s:g} s"
            )
            self.t0 = time.monotonic()
            stop = asyncio.Event()
            sampler = asyncio.create_task(self._sampler(stop))
            restart = (
                asyncio.create_task(self._restart_at(cfg.duration_s / 2)) if cfg.restart else None
            )
            await self.load(stub, rate)
            if restart is not None:
                await restart
            await asyncio.sleep(IDLE_DRAIN_S)  # NOTE: drain: leases, deferred frees, cache events
            stop.set()
            await sampler
            idle_from = time.monotonic() - self.t0
            for _ in range(IDLE_SAMPLES):
                await self.sample()
                await asyncio.sleep(1.0)
        held = await EngineProbe(self.stack).holding(self.request_ids)
        checks = verdict(
            self.samples,
            dict(self.outcomes),
            warmup_s=cfg.warmup_s,
            rss_growth=cfg.rss_growth,
            held_at_end={k: len(v) for k, v in held.items()},
            since=self.back,
            idle_from_s=idle_from,
        )
        return {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "capacity_rps": round(capacity, 3),
            "rate_rps": round(rate, 3),
            "requests": len(self.request_ids),
            "outcomes": dict(self.outcomes),
            "restarts_s": self.restarts,
            "back_s": self.back,
            "checks": [asdict(c) for c in checks],
            "ok": all(c.ok for c in checks),
            "samples": [asdict(s) for s in self.samples],
        }


def write(
    cfg: SoakConfig, result: dict, samples: Sequence[Sample], restarts: Sequence[float]
) -> None:
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    title = f"pdd bench soak, {cfg.duration_s / 60:.3g} min at {cfg.load:.0%} of capacity"
    (cfg.out / "soak.svg").write_text(render(samples, restarts, title))


def parse_args(argv: Sequence[str]) -> SoakConfig:
    d = SoakConfig()
    p = argparse.ArgumentParser(prog="pdd bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=d.out, help="folder for soak.json, soak.svg, logs")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="length of the load")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s, help="not judged before this")
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="seconds between samples")
    p.add_argument("--load", type=float, default=d.load, help="fraction of measured capacity")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="clients at capacity")
    p.add_argument("--capacity-s", type=float, default=d.capacity_s)
    p.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction)
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--restart", default=d.restart, help='service restarted at half time ("": none)')
    p.add_argument("--rss-growth", type=float, default=d.rss_growth, help="allowed RSS growth")
    p.add_argument("--model", default=d.model)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(list(argv))
    try:
        return SoakConfig(
            out=a.out,
            duration_s=a.duration_s,
            warmup_s=a.warmup_s,
            sample_s=a.sample_s,
            load=a.load,
            concurrency=a.concurrency,
            capacity_s=a.capacity_s,
            cancel_fraction=a.cancel_fraction,
            sessions=a.sessions,
            restart=a.restart,
            rss_growth=a.rss_growth,
            model=a.model,
            seed=a.seed,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:
        argv = argv[1:]
    cfg = parse_args(argv)
    stack = Stack(stack_config(cfg)).start()
    soak = Soak(cfg, stack, say=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        result = asyncio.run(soak.run())
    finally:
        stack.stop()
    write(cfg, result, soak.samples, soak.restarts)
    print(json.dumps({k: result[k] for k in ("capacity_rps", "rate_rps", "requests", "outcomes")}))
    print(render_checks([Check(**c) for c in result["checks"]]))
    print(f"wrote {cfg.out / 'soak.json'} and {cfg.out / 'soak.svg'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
