"""``pdd bench burst --own-stack``: the burst against a stack of its own, and the verdict.

Life of a run:
  1. start one Stack (its own Redis, kvstore, prefill, relay, MainDecode behind an emulated WAN,
     the gateway with its default adaptive bound; every service with /metrics);
  2. ``burst.run_burst`` against its gateway: capacity, then ``factor`` × that for
     ``duration_s`` (the issue's form: 5× for 60 s, 8 s deadlines, 96 output tokens);
  3. drain (``drain_s``), then look at the stack: every process still alive, no engine instance
     holding any of the run's requests (DescribeCache), every service's held gauges at 0
     (engine requests, fast-link regions, the gateway's requests in flight);
  4. ``burst_checks.burst_checks`` judges it; exit status 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.bench.burst import BurstConfig, run_burst
from pdd.bench.burst_checks import BurstBar, burst_checks
from pdd.bench.engine_probe import EngineProbe
from pdd.bench.soak_samples import HELD_WHEN_IDLE, Check, scrape_metrics
from pdd.testbed.stack import LinkSettings, Stack, StackConfig


@dataclass(frozen=True)
class OwnStack:
    model: str = "tiny:7,ctx=512"
    log_dir: Path = Path("pdd-burst/logs")
    wan_delay_ms: float = 20.0
    # Seconds after the last request ends before the stack is judged idle (leases, deferred frees).
    drain_s: float = 3.0
    engine_flags: tuple[str, ...] = ("--threads", "1")
    # More gateway flags (e.g. ``--admission-wait-s 0`` or ``--no-adaptive-in-flight``: a side
    # by side run of the front door's settings).
    gateway_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.drain_s < 0:
            raise ValueError(f"drain_s: must be >= 0, got {self.drain_s}")


def stack_config(own: OwnStack) -> StackConfig:
    return StackConfig(
        model=own.model,
        gateway_port=0,
        metrics=True,
        wan=LinkSettings(delay_ms=own.wan_delay_ms),
        engine_flags=own.engine_flags,
        gateway_flags=own.gateway_flags,
        log_dir=own.log_dir,
        key_prefix=f"burst{uuid.uuid4().hex[:8]}",
    )


async def look_after(stack: Stack, request_ids: list[str]) -> tuple[list[str], dict[str, float]]:
    """(the service processes that exited, what is still held where) once the run is over."""
    dead = [p.name for p in stack.processes if not p.alive()]
    held: dict[str, float] = {}
    for name, ids in (await EngineProbe(stack).holding(request_ids)).items():
        held[f"{name} holds_requests"] = len(ids)
    for p in stack.processes:
        gauges = await asyncio.to_thread(scrape_metrics, stack.metrics.get(p.name, ""))
        for gauge in HELD_WHEN_IDLE:
            if gauges.get(gauge):
                held[f"{p.name} {gauge}"] = gauges[gauge]
    return dead, held


class BoundWatch:
    """The gateway's admission bound and requests in flight, read from its /metrics every
    ``every_s`` while the run lasts: how the adaptive bound settles (``samples``: [monotonic s,
    limit, in flight])."""

    def __init__(self, metrics_address: str, every_s: float = 0.5) -> None:
        self.address, self.every_s = metrics_address, every_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bound-watch", daemon=True)

    def __enter__(self) -> BoundWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            gauges = scrape_metrics(self.address)
            if "pdd_gateway_in_flight_limit" in gauges:
                self.samples.append(
                    [
                        time.monotonic(),
                        gauges["pdd_gateway_in_flight_limit"],
                        gauges.get("pdd_requests_in_flight", 0.0),
                    ]
                )


def run_own_stack(
    cfg: BurstConfig, own: OwnStack = OwnStack(), bar: BurstBar = BurstBar(), say=print
) -> tuple[dict, list[Check]]:
    """Start a stack, burst it, judge it; the stack is stopped whatever happens."""
    stack = Stack(stack_config(own)).start()
    try:
        cfg = replace(cfg, gateway=stack.gateway.address)
        say(f"own stack up: gateway {cfg.gateway}, logs in {own.log_dir}")
        with BoundWatch(stack.metrics.get("gateway", "")) as watch:
            result = asyncio.run(run_burst(cfg))
        # NOTE: on the burst's clock (negative: the capacity phase)
        t0 = result["burst_t0_monotonic"]
        result["gateway_bound"] = [[round(t - t0, 2), *rest] for t, *rest in watch.samples]
        time.sleep(own.drain_s)
        dead, held = asyncio.run(look_after(stack, result["request_ids"]))
    finally:
        stack.stop()
    checks = burst_checks(result, dead=dead, held=held, bar=bar)
    result["own_stack"] = {"model": own.model, "dead": dead, "held": held}
    return result, checks
