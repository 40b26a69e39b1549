"""EngineLoop: its measured step interval (what MainDecode reports to the relay for pacing), an
idle engine gathering a burst before its first step (``Coalesce``, prefill's default), and a
request's own work run after each step on the engine thread (``after_step``)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from pdd.engine import Engine, EngineConfig
from pdd.engine.sampling import SamplingParams
from pdd.serving.engine_loop import Coalesce, EngineLoop
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
        self.batches: list[list[str]] = []  # the requests of every step, in order

    def add(self, rid: str, tokens: int) -> None:
        self.left[rid] = tokens

    def has_schedulable(self) -> bool:
        return bool(self.left)

    def num_computed_total(self) -> int:
        return self.done

    def holds_request(self, rid: str) -> bool:
        return rid in self.left

    def step(self) -> list[_Out]:
        self.batches.append(sorted(self.left))
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


async def test_after_step_work_runs_on_the_engine_thread_between_steps_behind_the_outputs():
    """A request's ``after_step`` work runs on the engine thread after every step and before the
    next; the step's outputs are on their way first (here the work waits for the output to reach
    the request's queue); work that raises is logged and the engine steps on; ``close`` ends it."""
    engine = SlowEngine(0.01)
    runner = EngineLoop(engine)
    await runner.start()
    seen: list[tuple[str, int]] = []
    output_in = threading.Event()

    def after() -> None:
        assert threading.current_thread() is runner._thread
        seen.append(("after", len(engine.batches)))
        if len(engine.batches) == 1:
            assert output_in.wait(30), "the step's output was held back by its after_step work"
        if len(engine.batches) == 2:
            raise RuntimeError("a failing export")  # NOTE: logged; the engine steps on

    try:
        q = runner.open("a")
        runner.after_step("a", after)
        await runner.call(engine.add, "a", 4)
        first = await asyncio.wait_for(q.get(), 10)
        output_in.set()
        assert first.request_id == "a"
        await asyncio.wait_for(_drain(q), 10)
        await runner.call(lambda: None)  # the last step's work has run
        assert seen == [("after", 1), ("after", 2), ("after", 3), ("after", 4)]
        runner.close("a")
        q = runner.open("b")
        await runner.call(engine.add, "b", 2)
        await asyncio.wait_for(_drain(q), 10)
        assert len(seen) == 4  # a's work ended with its close
    finally:
        await runner.stop()


async def _burst(
    coalesce: Coalesce | None, count: int, spacing_s: float, hints: list[int] | None = None
) -> SlowEngine:
    """``count`` requests of 3 steps each, ``spacing_s`` apart, into an idle loop; run to the end.
    ``hints``: how many more each request says follow it (``expect``)."""
    engine = SlowEngine(0.2)
    runner = EngineLoop(engine, coalesce)
    await runner.start()
    try:
        queues = []
        for i in range(count):
            queues.append(runner.open(f"r{i}"))
            if hints is not None:
                runner.expect(hints[i])
            runner.submit(engine.add, f"r{i}", 3)
            await asyncio.sleep(spacing_s)
        for q in queues:
            await _drain(q)
    finally:
        await runner.stop()
    return engine


async def test_an_idle_engine_gathers_a_burst_into_its_first_step():
    engine = await _burst(Coalesce(max_s=3.0, gap_s=0.4), count=5, spacing_s=0.05)
    assert engine.batches[0] == ["r0", "r1", "r2", "r3", "r4"]
    assert len(engine.batches) == 3  # all five together, three steps


async def test_a_burst_whose_routing_stalls_is_still_gathered_when_told_so():
    """Arrivals 0.5 s apart against a 0.2 s gap: without hints each steps alone; with each
    request saying how many more follow, the first step waits for all of them."""
    gather = Coalesce(max_s=3.0, gap_s=0.2)
    apart = await _burst(gather, 3, 0.5, hints=[0, 0, 0])
    assert apart.batches[0] == ["r0"]
    told = await _burst(gather, 3, 0.5, hints=[2, 1, 0])
    assert told.batches[0] == ["r0", "r1", "r2"]


async def test_a_hint_never_holds_the_first_step_past_max_s():
    """Followers promised but never sent: the step waits ``max_s``, not for ever."""
    engine = SlowEngine(0.05)
    runner = EngineLoop(engine, Coalesce(max_s=0.6, gap_s=0.1))
    await runner.start()
    try:
        q = runner.open("a")
        started = time.perf_counter()
        runner.expect(5)
        runner.submit(engine.add, "a", 1)
        await _drain(q)
        waited = time.perf_counter() - started
        assert 0.5 <= waited < 3.0, waited  # NOTE: the bound, with a wide margin above it
    finally:
        await runner.stop()


async def test_a_hint_older_than_max_s_counts_for_nothing():
    """A hint left from an earlier burst (its followers went elsewhere) does not hold a later
    lone request: it waits one gap, not ``max_s``."""
    engine = SlowEngine(0.05)
    runner = EngineLoop(engine, Coalesce(max_s=1.5, gap_s=0.1))
    await runner.start()
    try:
        runner.expect(5)
        await asyncio.sleep(2.0)  # older than max_s when the next request comes
        q = runner.open("a")
        started = time.perf_counter()
        runner.submit(engine.add, "a", 1)
        await _drain(q)
        assert time.perf_counter() - started < 1.0  # NOTE: ~0.15 s; 1.5 s had the hint counted
    finally:
        await runner.stop()


async def test_without_gathering_the_first_request_steps_alone():
    """The same burst, no ``Coalesce``: the first step holds only the first arrival."""
    engine = await _burst(None, count=5, spacing_s=0.05)
    assert engine.batches[0] == ["r0"]


async def test_the_gathering_wait_is_bounded_by_max_s():
    """Requests that keep coming (each within the gap) do not hold the first step past max_s."""
    engine = await _burst(Coalesce(max_s=0.3, gap_s=0.25), count=12, spacing_s=0.1)
    first = engine.batches[0]
    assert "r0" in first and len(first) < 12  # the step began before the stream of arrivals ended


async def test_a_busy_engine_does_not_wait_for_more():
    """Gathering is only for an idle engine's first step: one already stepping takes a new
    request into its next step, however long the gap."""
    engine = SlowEngine(0.05)
    runner = EngineLoop(engine, Coalesce(max_s=5.0, gap_s=2.0))
    await runner.start()
    try:
        a, b = runner.open("a"), runner.open("b")
        await runner.call(engine.add, "a", 40)  # the loop gathers for 2 s, then steps
        await a.get()  # a's first token: the engine is stepping now
        steps = len(engine.batches)
        await runner.call(engine.add, "b", 2)
        await _drain(b)
        joined = next(i for i, batch in enumerate(engine.batches) if "b" in batch)
        # NOTE: a 2 s wait would be ~40 steps of 0.05 s; "b" joins within a step or two.
        assert joined - steps <= 3
        await _drain(a)
    finally:
        await runner.stop()


async def test_stop_ends_a_gathering_wait():
    engine = SlowEngine(0.01)
    runner = EngineLoop(engine, Coalesce(max_s=30.0, gap_s=30.0))
    await runner.start()
    runner.submit(engine.add, "r", 3)
    await asyncio.sleep(0.1)  # the thread is waiting for more
    started = time.perf_counter()
    await runner.stop()
    assert time.perf_counter() - started < 5.0  # not the 30 s wait
    assert engine.batches == []  # stopped before the first step


def test_a_gap_longer_than_the_wait_is_refused():
    with pytest.raises(ValueError, match="gap_s"):
        Coalesce(max_s=0.01, gap_s=0.02)


async def test_an_engine_built_by_the_loop_is_built_and_stepped_on_one_thread():
    """``EngineLoop.build``: construction runs on the engine thread, the thread every step and
    call then runs on (one OpenMP master per process), and a failed build is the caller's error."""
    threads: dict[str, int] = {}

    def build() -> SlowEngine:
        threads["build"] = threading.get_ident()
        return SlowEngine(0.001)

    runner = await EngineLoop.build(build)
    engine = runner.engine
    assert isinstance(engine, SlowEngine) and threads["build"] != threading.get_ident()
    q = runner.open("r")
    await runner.call(engine.add, "r", 2)
    await asyncio.wait_for(_drain(q), 5)
    assert await runner.call(threading.get_ident) == threads["build"]
    await runner.stop()

    def broken() -> SlowEngine:
        raise ValueError("model: no such file")

    with pytest.raises(ValueError, match="model: no such file"):
        await asyncio.wait_for(EngineLoop.build(broken), 5)

    # A caller that gives up while the engine builds (a service stopped during its model load):
    # the build finishes, the thread ends without stepping.
    release = threading.Event()
    loops: list[threading.Thread] = []

    def slow() -> SlowEngine:
        loops.append(threading.current_thread())
        release.wait(5)
        return SlowEngine(0.001)

    starting = asyncio.ensure_future(EngineLoop.build(slow))
    while not loops:
        await asyncio.sleep(0.01)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    release.set()
    loops[0].join(5)
    assert not loops[0].is_alive()
