"""EngineLoop's measured step interval (what MainDecode reports to the relay for pacing)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdd.engine import Engine, EngineConfig
from pdd.engine.sampling import SamplingParams
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.model_spec import load_model


@dataclass
class _Out:
    request_id: str
    position: int
    token_id: int
    finished: bool
    finish_reason: str | None = None


class SlowEngine:
    """Steps take at least ``step_s``; a request runs ``tokens`` steps once added."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.left: dict[str, int] = {}
        self.done = 0

    def add(self, rid: str, tokens: int) -> None:
        self.left[rid] = tokens

    def has_schedulable(self) -> bool:
        return bool(self.left)

    def num_computed_total(self) -> int:
        return self.done

    def holds_request(self, rid: str) -> bool:
        return rid in self.left

    def step(self) -> list[_Out]:
        time.sleep(self.step_s)
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.done += 1
            finished = self.left[rid] == 0
            outs.append(_Out(rid, self.done, 1, finished))
            if finished:
                del self.left[rid]
        return outs


async def _drain(q: asyncio.Queue) -> None:
    while not (await q.get()).finished:
        pass


async def test_interval_follows_busy_steps_and_ignores_idle_gaps():
    engine = SlowEngine(0.02)
    runner = EngineLoop(engine)
    await runner.start()
    try:
        assert runner.step_interval_s == 0.0  # unknown until measured
        q = runner.open("a")
        await runner.call(engine.add, "a", 10)
        await _drain(q)
        busy = runner.step_interval_s
        # NOTE: lower bound only: a sleep never ends early.
        assert busy >= 0.02
        await asyncio.sleep(1.0)  # idle: must not count as a step interval
        q = runner.open("b")
        await runner.call(engine.add, "b", 3)
        await _drain(q)
        # Had the 1 s idle gap been averaged in (weight 0.1) the estimate would exceed 0.1 s.
        assert runner.step_interval_s < 0.1
    finally:
        await runner.stop()


async def test_interval_measured_on_a_real_engine():
    engine = Engine(
        load_model("tiny:3,ctx=256,layers=2,hidden=64,inter=128"), EngineConfig(block_size=4)
    )
    runner = EngineLoop(engine)
    await runner.start()
    try:
        q = runner.open("r")
        await runner.call(engine.add_request, "r", (1, 2, 3, 4, 5), SamplingParams(max_tokens=12))
        await _drain(q)
        assert runner.step_interval_s > 0
    finally:
        await runner.stop()
