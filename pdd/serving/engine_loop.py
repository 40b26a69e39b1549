"""An asyncio face for the (synchronous, single-threaded) engine: its step loop.

The engine is not thread-safe, so every touch of it — a step, adding or
aborting a request, importing or exporting KV — runs on one dedicated worker
thread, in submission order. The step loop runs on that thread too: between
two steps, queued mutations run. Each step's outputs are routed to the
asyncio queue of the request they belong to (the items: ``pdd.serving.mailbox``).

Life of a request through the loop: ``open(request_id)`` gives its queue →
``call(engine.add_request, ...)`` → the loop steps while the engine has
schedulable work → a watched request gets ``Computed(n)`` after each step →
each ``StepOutput`` lands in the queue (a failed step: ``StepFailed``) →
``close(request_id)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from pdd.serving.mailbox import Computed, StepFailed

log = structlog.get_logger(__name__)
T = TypeVar("T")

# One engine step, as seen from the loop: outputs, whether anything moved, watched progress.
_StepResult = tuple[list, bool, list[tuple[str, int]]]


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("engine_call_failed", error=repr(future.exception()))


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine"
        )
        self._queues: dict[str, asyncio.Queue] = {}
        # Requests whose computed-token count is reported after every step (``Computed``).
        self._watched: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0
        # Smoothed time between back-to-back steps: what a decoding request waits per token here.
        self.step_interval_s = 0.0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._pool.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps."""
        assert self._loop is not None, "EngineLoop.start() was not awaited"
        result = await self._loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        self._wake.set()
        return result

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the engine thread without waiting (cleanup that must not be
        cancelled)."""
        future = self._pool.submit(fn, *args)
        future.add_done_callback(_log_failure)
        self._wake.set()

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
        self._watched.discard(request_id)

    def watch(self, request_id: str) -> None:
        """Also put ``Computed(n)`` on the request's queue after each step (KV streaming)."""
        self._watched.add(request_id)

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_step: float | None = None  # when the previous step ended, if the engine stayed busy
        while True:
            try:
                # NOTE: check and step in one trip to the engine thread: a separate check would
                # cost every step an extra event-loop round trip.
                result = await loop.run_in_executor(
                    self._pool, self._step_if_schedulable, tuple(self._watched)
                )
            except Exception:  # noqa: BLE001 — a failed step must not kill the service silently
                log.exception("engine_step_failed")
                await self._fail_all()
                continue
            if result is None:
                last_step = None
                await self._idle()
                continue
            outputs, progressed, computed = result
            self.steps += 1
            now = loop.time()
            if last_step is not None and outputs:
                self._note_interval(now - last_step)
            last_step = now if outputs else None
            if not progressed:
                await self._stalled()
            self._route(outputs, computed)

    async def _idle(self) -> None:
        """Nothing schedulable: sleep until a call or a wake."""
        self._wake.clear()
        # NOTE: re-check after clearing: a call() may have landed in between.
        schedulable = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.engine.has_schedulable
        )
        if not schedulable:
            await self._wake.wait()

    async def _stalled(self) -> None:
        # NOTE: nothing fit (pool full of paused/kept requests); wait for a change, don't spin.
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), 0.05)
        except TimeoutError:
            pass

    def _route(self, outputs: list, computed: list[tuple[str, int]]) -> None:
        # NOTE: progress before outputs: a request's last chunk is reported before its token.
        for request_id, n in computed:
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(Computed(n))
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

    def _step_if_schedulable(self, watched: tuple[str, ...]) -> _StepResult | None:
        return self._step(watched) if self.engine.has_schedulable() else None

    def _step(self, watched: tuple[str, ...]) -> _StepResult:
        """One engine step on the engine thread: outputs, whether anything moved, watched progress."""
        eng = self.engine
        before = eng.num_computed_total()
        outputs = eng.step()
        computed = [(rid, eng.num_cached_tokens(rid)) for rid in watched if eng.holds_request(rid)]
        return outputs, bool(outputs) or eng.num_computed_total() != before, computed

    async def _fail_all(self) -> None:
        for request_id, q in list(self._queues.items()):
            q.put_nowait(StepFailed(RuntimeError("engine step failed")))
            try:
                await self.call(self.engine.abort, request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort_failed", request_id=request_id)
