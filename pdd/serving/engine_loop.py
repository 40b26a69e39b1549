"""An asyncio face for the (synchronous, single-threaded) engine: its step loop.

The engine is not thread-safe, so every touch of it — a step, adding or aborting a request,
importing or exporting KV — runs on one dedicated engine thread, in submission order. That
thread steps on its own while the engine has schedulable work, running queued calls between two
steps, and hands each step's outputs to the event loop (``call_soon_threadsafe``), which routes
them to the asyncio queue of the request they belong to (the items: ``pdd.serving.mailbox``).

An idle engine that gets work may wait a moment for more before its first step (``Coalesce``,
prefill's default): a burst's requests reach it a few ms apart, and a first step over only the
first of them made the rest wait that whole step — and in a one-host stack, MainDecode then
decoded that one request alone on the cores the rest's prefill needed (measured: 16 requests at
once, prefill's steps 1 + 15 requests, 40 + 632 ms, against 335 ms for all 16 in one). A request
may also say how many more its gateway is still routing behind it (``expect``): then the gather
waits for those past a gap too, within ``max_s`` — the gateway's routing of a burst (kvstore's
answers) can stall for longer than a gap while the first requests are already here.

Engines of one host that share its cores may take turns at their steps (``turns``,
``pdd.serving.core_turns``): each step then holds the host's turn lock.

NOTE: the engine never waits for the event loop between steps: the loop's work of a step
(routing outputs, one gRPC write per stream) overlaps the next step instead of following it.
An earlier loop ran each step as an executor call awaited by a task, so every step also waited
for the event loop to come round to that task; under a full batch that is the loop's whole
backlog of stream writes.

A request may also have work of its own run right after each step, on the engine thread,
before the next step starts (``after_step``): prefill exports the KV a step computed into the
links' buffers there. Asked of the event loop instead, that export waited for the loop to see
the step's output and for the engine thread to come back between steps — behind the whole next
step (measured: a burst split over two prefill steps, its first half's KV left ~330 ms later).

Life of a request through the loop: ``open(request_id)`` gives its queue →
``call(engine.add_request, ...)`` → the thread steps while the engine has schedulable work →
each ``StepOutput`` lands in the queue (a failed step: ``StepFailed``), then the request's
``after_step`` work runs → ``close(request_id)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from pdd.serving.core_turns import CoreTurns
from pdd.serving.mailbox import StepFailed

log = structlog.get_logger(__name__)
T = TypeVar("T")

# How long a step that moved nothing (everything paused, or the pool full) waits for a change.
STALL_WAIT_S = 0.05


class _Stop:
    """The engine thread's last work item."""


@dataclass(frozen=True)
class Coalesce:
    """How an idle engine's first step waits for a burst: while calls keep arriving, each within
    ``gap_s`` of the last, for at most ``max_s`` in all. A lone request pays ``gap_s``."""

    max_s: float
    gap_s: float

    def __post_init__(self) -> None:
        if not 0 < self.gap_s <= self.max_s:
            raise ValueError(f"gap_s: need 0 < gap_s <= max_s, got {self.gap_s}, {self.max_s}")


class EngineLoop:
    def __init__(
        self, engine: Any, coalesce: Coalesce | None = None, turns: CoreTurns | None = None
    ) -> None:
        self.engine = engine
        self.coalesce = coalesce
        # Steps taken in turns with the host's other engines (``pdd.serving.core_turns``).
        self.turns = turns
        # Work for the engine thread between steps: (fn, future or None), or _Stop.
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._queues: dict[str, asyncio.Queue] = {}
        # Work run on the engine thread after every step, per request (``after_step``); changed
        # on the event loop, read by the engine thread under the lock.
        self._after: dict[str, Callable[[], None]] = {}
        self._after_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0
        # (requests still to come, time.perf_counter() when told): the last arrival's hint.
        self._following: tuple[int, float] = (0, 0.0)
        # Smoothed time between back-to-back steps: what a decoding request waits per token here.
        self.step_interval_s = 0.0

    async def start(self, build: Callable[[], Any] | None = None) -> None:
        """Start the engine thread; with ``build``, it first makes the engine (``build``)."""
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future = self._loop.create_future()

        def work() -> None:
            if build is not None:
                try:
                    self.engine = build()
                except BaseException as exc:  # noqa: BLE001 — it belongs to the caller
                    self._post(_settle, started, None, exc)
                    return
            self._post(_settle, started, None, None)
            self._work()

        self._thread = threading.Thread(target=work, name="engine", daemon=True)
        self._thread.start()
        try:
            await asyncio.shield(started)
        except BaseException:
            # NOTE: a build that fails ends the thread; one the caller gave up on (cancelled)
            # finishes building, finds the stop and never steps.
            self._stopped = True
            self._calls.put(_Stop)
            self._wakeup.set()
            raise

    @classmethod
    async def build(
        cls,
        build: Callable[[], Any],
        coalesce: Coalesce | None = None,
        turns: CoreTurns | None = None,
    ) -> EngineLoop:
        """A started loop whose engine ``build()`` makes on the engine thread itself.

        NOTE: the engine thread is then the process's only OpenMP master. libgomp counts every
        thread pool's workers against the CPUs, and once they outnumber them every parallel
        region's workers stop spinning (an engine built on an executor thread leaves a second
        pool behind: 3 threads on 2 CPUs)."""
        loop = cls(None, coalesce, turns)
        await loop.start(build)
        return loop

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._calls.put(_Stop)
            self._wakeup.set()
            await asyncio.to_thread(self._thread.join)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps."""
        assert self._loop is not None, "EngineLoop.start() was not awaited"
        future: asyncio.Future = self._loop.create_future()
        self._put(lambda: fn(*args, **kwargs), future)
        return await future

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the engine thread without waiting (cleanup that must not be
        cancelled)."""
        self._put(lambda: fn(*args), None)

    def _put(self, fn: Callable[[], Any], future: asyncio.Future | None) -> None:
        if self._stopped:
            raise RuntimeError("the engine loop is stopped")
        self._calls.put((fn, future))
        self._wakeup.set()

    def call_threadsafe(self, fn: Callable[[], None]) -> None:
        """Schedule ``fn`` on the asyncio loop from the engine thread (e.g. cache events)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        with self._after_lock:
            self._after.pop(request_id, None)

    def after_step(self, request_id: str, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine thread after every step, before the next, until ``close``.

        It runs after the step's outputs were handed to the event loop, so it never holds a
        token back; a call queued once the loop has seen a step's output runs after that step's
        ``fn``. ``fn`` tells whoever waits on it of its own failures (prefill's feed fails its
        links' buffers): an exception it raises is only logged, and the engine steps on."""
        with self._after_lock:
            self._after[request_id] = fn

    def wake(self) -> None:
        self._wakeup.set()

    def expect(self, following: int) -> None:
        """An arriving request's hint: ``following`` more are being routed right behind it. An
        idle engine's burst gather (``Coalesce``) then waits for them past a gap, within its
        ``max_s``; the latest hint wins, and one older than ``max_s`` counts for nothing."""
        self._following = (max(0, following), time.perf_counter())

    # --- the engine thread ---------------------------------------------------------------------

    def _work(self) -> None:
        last_step: float | None = None  # when the previous step ended, if the engine stayed busy
        idle = True  # the engine had nothing to step when it last looked
        while True:
            if not self._run_calls():
                return
            try:
                schedulable = self.engine.has_schedulable()
                if schedulable and idle and self.coalesce is not None:
                    if not self._gather_burst(self.coalesce):
                        return
                idle = not schedulable
                if schedulable:
                    outputs, progressed = self._step()
            except Exception:  # noqa: BLE001 — a failed step must not kill the service silently
                log.exception("engine_step_failed")
                self._post(self._fail_all)
                last_step = None
                self._wakeup.clear()
                self._wakeup.wait(STALL_WAIT_S)
                continue
            if not schedulable:
                last_step = None
                # NOTE: clear, then re-check: a call that landed in between sets it again.
                self._wakeup.clear()
                if self._calls.empty() and not self.engine.has_schedulable():
                    self._wakeup.wait()
                continue
            self.steps += 1
            now = time.perf_counter()
            if last_step is not None and outputs:
                self._note_interval(now - last_step)
            last_step = now if outputs else None
            if outputs:
                self._post(self._route, outputs)
            self._run_after_step()
            if not progressed:
                # NOTE: nothing fit (pool full of paused/kept requests): wait for a change.
                self._wakeup.clear()
                if self._calls.empty():
                    self._wakeup.wait(STALL_WAIT_S)

    def _gather_burst(self, coalesce: Coalesce) -> bool:
        """Run the calls that keep arriving (each within ``gap_s``, ``max_s`` in all) before an
        idle engine's first step; False once told to stop."""
        deadline = time.perf_counter() + coalesce.max_s
        while (left := deadline - time.perf_counter()) > 0:
            # NOTE: clear, then check the queue: a call that landed in between sets it again.
            self._wakeup.clear()
            if self._calls.empty() and not self._wakeup.wait(min(coalesce.gap_s, left)):
                following, told = self._following
                if following <= 0 or time.perf_counter() - told > coalesce.max_s:
                    return True  # the burst is over
                continue  # NOTE: more are on their way: wait for them (within max_s)
            if not self._run_calls():
                return False
        return True

    def _run_calls(self) -> bool:
        """Run every queued call (each future gets its result); False once told to stop."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return True
            if item is _Stop:
                return False
            fn, future = item
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 — it belongs to the caller
                if future is None:
                    log.error("engine_call_failed", error=repr(exc))
                else:
                    self._post(_settle, future, None, exc)
                continue
            if future is not None:
                self._post(_settle, future, result, None)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # NOTE: the event loop is closed: nobody is left to tell
            pass

    def _run_after_step(self) -> None:
        with self._after_lock:
            work = tuple(self._after.values())
        for fn in work:
            try:
                fn()
            except Exception:  # noqa: BLE001 — one request's hook must not stop the engine
                log.exception("after_step_failed")

    def _route(self, outputs: list) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _note_interval(self, seconds: float) -> None:
        # NOTE: an EWMA over ~10 steps: follows load changes within a few handoffs, ignores one
        # slow step.
        self.step_interval_s = (
            seconds if self.step_interval_s == 0 else 0.9 * self.step_interval_s + 0.1 * seconds
        )

    def _step(self) -> tuple[list, bool]:
        """One engine step: its outputs, and whether anything moved."""
        eng = self.engine
        before = eng.num_computed_total()
        with self.turns.step() if self.turns is not None else contextlib.nullcontext():
            outputs = eng.step()
        return outputs, bool(outputs) or eng.num_computed_total() != before

    def _fail_all(self) -> None:
        """On the event loop: every open request learns its engine failed, and is aborted."""
        for request_id, q in list(self._queues.items()):
            q.put_nowait(StepFailed(RuntimeError("engine step failed")))
            if not self._stopped:
                self.submit(self.engine.abort, request_id)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return  # NOTE: the caller went away; the call itself ran (it is not undone)
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
