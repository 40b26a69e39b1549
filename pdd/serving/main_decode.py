"""MainDecode's request life: DRC hit → KV delta → (handoff) → decode.

Life of a request (one ``decode`` generator per request, opened by the gateway):
  1. ``add_request(paused)``: the prompt is matched against the DRC (the
     engine's radix cache of prompts *and* outputs); the hit is locked and
     reported — prefill pushes KV only from there on;
  2. the pushed delta is reassembled by the ``KvReceiver`` (chunks in any
     order, duplicates ignored, checksums checked) and imported;
  3. P-MD: prefill's first token is appended and decoding starts at once;
     P-RLD-MD: the relay hands over with ``handoff`` — token IDs only. Each
     batch is *extended* in one forward pass (``append_tokens``); MainDecode
     starts emitting at the final batch's end. A request that already
     finished upstream is extended into the DRC and emits nothing;
  MD (conditional disaggregation): no prefill stage and no push — the engine
     prefills the short uncached suffix in its own batch, samples position 0
     and MainDecode speaks from the first token;
  4. every output is streamed with its position; finishing inserts prompt +
     output into the DRC (cache events reach kvstore), so the session's next
     turn hits here.
Cancellation (the gateway's call ends) aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from pdd.core.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import (
    Accepted,
    DecodeJob,
    Finished,
    HandoffAck,
    HandoffBatch,
    KvReadiness,
    Tokens,
)
from pdd.engine.sampling import Logprob
from pdd.kv.receiver import KvReceiver
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import import_range
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)


@dataclass
class _State:
    job: DecodeJob
    queue: asyncio.Queue
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)
    # Highest output position the engine has produced (or reached by an extension).
    produced: int = -1
    finished: bool = False
    finish_reason: str | None = None
    outputs: dict[int, int] = field(default_factory=dict)
    # Of the outputs this engine sampled (not those another stage's tokens extended), when asked for.
    logprobs: dict[int, Logprob] = field(default_factory=dict)
    wan_bytes: int = 0
    extend_s: float = 0.0


class MainDecode:
    def __init__(
        self, instance: EngineInstance, receiver: KvReceiver, *, kv_timeout_s: float = 600.0
    ) -> None:
        self.instance = instance
        self.receiver = receiver
        self.kv_timeout_s = kv_timeout_s
        self._requests: dict[str, _State] = {}

    @property
    def runner(self):
        return self.instance.runner

    @property
    def engine(self):
        return self.instance.engine

    async def decode(self, job: DecodeJob) -> AsyncIterator[Accepted | Tokens | Finished]:
        rid = job.request_id
        if rid in self._requests:
            raise InvalidArgumentError("request_id", f"{rid!r} is already decoding here")
        state = _State(job, self.runner.open(rid))
        self._requests[rid] = state
        done = False
        kv_task: asyncio.Task | None = None
        try:
            local = job.pipeline is Pipeline.MD

            def admit() -> int:
                self.engine.add_request(
                    rid, job.prompt_token_ids, job.sampling, salt=job.cache_salt, paused=not local
                )
                return self.engine.num_cached_tokens(rid)

            cached = await self.runner.call(admit)
            metrics.PREFIX_QUERIES.labels("main_decode").inc(len(job.prompt_token_ids))
            metrics.PREFIX_HITS.labels("main_decode").inc(cached)
            log.info("md_accepted", cached_tokens=cached, prompt_tokens=len(job.prompt_token_ids))
            yield Accepted(cached)
            emit_from: int | None = None
            if local:
                state.kv_ready.set()  # NOTE: nothing to receive: a stray handoff must not wait for KV
                emit_from = 0
            else:
                kv_task = asyncio.create_task(self._receive_kv(state))
            md_tokens = 0
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple) and item[0] == "extended":
                    await self._apply_extension(state, *item[1:])
                    continue
                if isinstance(item, tuple):  # ("emit_from", n): the position MainDecode speaks from
                    emit_from = item[1]
                    ready = sorted(p for p in state.outputs if p >= emit_from)
                    if ready:
                        md_tokens += len(ready)
                        yield Tokens(
                            ready[0],
                            tuple(state.outputs[p] for p in ready),
                            self._logprobs(state, ready),
                        )
                    if state.finished:
                        done = True
                        yield self._finished(state, state.finish_reason, md_tokens)
                        return
                    continue
                await self._note(state, item)
                if (
                    item.token_id is not None
                    and emit_from is not None
                    and item.position >= emit_from
                ):
                    md_tokens += 1
                    yield Tokens(
                        item.position, (item.token_id,), self._logprobs(state, [item.position])
                    )
                if item.finished:
                    state.finish_reason = item.finish_reason
                    if emit_from is not None:
                        done = True
                        yield self._finished(state, item.finish_reason, md_tokens)
                        return
        finally:
            if kv_task is not None:
                kv_task.cancel()
            self._requests.pop(rid, None)
            self.runner.close(rid)
            if not done:
                self.receiver.discard(rid)
                self.runner.submit(
                    self.engine.abort, rid
                )  # NOTE: not awaited: runs even when cancelled
                log.info("md_request_aborted")

    @staticmethod
    def _logprobs(state: _State, positions: list[int]) -> tuple[Logprob, ...]:
        if state.job.sampling.logprobs is None:
            return ()
        missing = [p for p in positions if p not in state.logprobs]
        if missing:  # NOTE: MainDecode speaks only from where it sampled; anything else is a bug
            raise FailedPreconditionError(
                f"no logprobs for outputs {missing[:5]} of {state.job.request_id}"
            )
        return tuple(state.logprobs[p] for p in positions)

    def _finished(self, state: _State, reason: str | None, md_tokens: int) -> Finished:
        return Finished(
            reason,
            max(state.outputs, default=-1) + 1,
            md_tokens,
            state.wan_bytes,
            state.extend_s * 1000,
        )

    async def _note(self, state: _State, out) -> None:
        if out.token_id is not None:
            state.outputs[out.position] = out.token_id
            if out.logprob is not None:
                state.logprobs[out.position] = out.logprob
        async with state.progress:
            state.produced = max(state.produced, out.position)
            state.finished = state.finished or out.finished
            state.progress.notify_all()

    async def _receive_kv(self, state: _State) -> None:
        rid = state.job.request_id
        try:
            kv = await self.receiver.wait_complete(rid, self.kv_timeout_s)
            t0 = time.perf_counter()
            await self.runner.call(import_range, self.engine, rid, kv.header, kv.payload)
            self.receiver.pop(rid)
            state.wan_bytes = kv.wire_bytes
            metrics.WAN_BYTES.labels("received").inc(kv.wire_bytes)
            metrics.WAN_TRANSFER.labels("received").observe(kv.elapsed_s)
            state.kv_ready.set()
            log.info(
                "md_kv_imported",
                tokens=kv.header.num_tokens,
                wire_bytes=kv.wire_bytes,
                transfer_s=round(kv.elapsed_s, 4),
                import_ms=round((time.perf_counter() - t0) * 1000, 2),
            )
            if state.job.pipeline is Pipeline.P_MD:
                first = list(kv.output_token_ids)
                t1 = time.perf_counter()
                # NOTE: expedited: the client waits on this first decode step (TTFDT).
                await self._append(state, 0, first, expedite=True)
                state.extend_s += time.perf_counter() - t1
                state.queue.put_nowait(("emit_from", len(first)))
        except Exception as exc:  # noqa: BLE001 — surfaced on the request's stream
            state.queue.put_nowait(exc)

    @property
    def decode_interval_s(self) -> float:
        """Recent time between this engine's decode steps (0 until measured): the relay paces to it."""
        return self.runner.step_interval_s

    async def wait_kv_ready(self, request_id: str, timeout_ms: int) -> KvReadiness:
        """Long-poll (at most ``timeout_ms``) until this MainDecode holds the request's KV."""
        state = self._requests.get(request_id)
        if state is None:
            raise NotFoundError(f"request_id: {request_id!r} is not decoding here")
        try:
            await asyncio.wait_for(state.kv_ready.wait(), timeout_ms / 1000)
            ready = True
        except TimeoutError:
            ready = False
        return KvReadiness(ready, self.decode_interval_s * 1000)

    async def handoff(self, batch: HandoffBatch) -> HandoffAck:
        """Extend one handoff batch (see ``_extend_handoff``) and acknowledge it."""
        t0 = time.perf_counter()
        through, computed = await self._extend_handoff(
            batch.request_id, batch.start_position, list(batch.token_ids), final=batch.final
        )
        return HandoffAck(
            through, computed, (time.perf_counter() - t0) * 1000, self.decode_interval_s * 1000
        )

    async def _extend_handoff(
        self, request_id: str, start: int, token_ids: list[int], *, final: bool
    ) -> tuple[int, int]:
        """Extend ``token_ids`` at output ``start``.

        Returns (outputs extended through, outputs computed here). Between rounds
        MainDecode keeps decoding *ahead* of the relay (its tokens equal the
        relay's for greedy and seeded sampling), so a round whose tokens it
        already computed costs no engine step: the final one then lets MainDecode
        speak at once instead of after an extend step.
        """
        state = self._requests.get(request_id)
        if state is None:
            raise NotFoundError(f"request_id: {request_id!r} is not decoding here")
        if state.job.pipeline is not Pipeline.P_RLD_MD:
            raise FailedPreconditionError(
                f"request_id: {request_id!r} is a {state.job.pipeline.value} request; "
                "only P-RLD-MD requests are handed over"
            )
        try:
            await asyncio.wait_for(state.kv_ready.wait(), self.kv_timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"KV of {request_id} did not arrive in {self.kv_timeout_s} s"
            ) from None
        target = start + len(token_ids)
        agrees = all(state.outputs.get(start + i) == t for i, t in enumerate(token_ids))
        if state.finished:
            # NOTE: MainDecode ran ahead to the end during catch-up; it must agree with the relay.
            if not agrees:
                raise FailedPreconditionError(
                    f"handoff tokens disagree with {request_id}'s finished outputs"
                )
        elif not (agrees and state.produced >= target):
            t0 = time.perf_counter()
            appended = await self._append(state, start, token_ids, expedite=final)
            async with state.progress:
                # The extension is computed once the engine produced the position after it (or finished).
                await state.progress.wait_for(lambda: state.produced >= target or state.finished)
            if not appended and not all(
                state.outputs.get(start + i) == t for i, t in enumerate(token_ids)
            ):
                # NOTE: MainDecode finished ahead while this round was on its way: its outputs stand
                # and must agree with the relay's, or the stream would mix two paths.
                raise FailedPreconditionError(
                    f"handoff tokens disagree with {request_id}'s finished outputs"
                )
            state.extend_s += time.perf_counter() - t0
        if final:
            state.queue.put_nowait(("emit_from", target))
        return target, max(target, state.produced + 1)

    async def _append(
        self, state: _State, start: int, token_ids: list[int], *, expedite: bool
    ) -> bool:
        """Make ``token_ids`` the outputs from ``start`` (extend: computed in one pass); what
        MainDecode decoded ahead is kept where it agrees and dropped from the first disagreement.

        ``expedite``: the client is waiting on this extension (the relay has stopped, or it is
        P-MD's first decode step), so it gets an engine step of its own. False when the engine
        no longer holds the request (it finished, or was aborted): nothing was appended.
        """
        rid = state.job.request_id

        def run() -> bool | None:
            if not self.engine.holds_request(rid):
                return None
            rolled_back = self.engine.append_tokens(rid, token_ids, start)
            self.engine.resume(rid)
            if expedite:
                self.engine.expedite(rid)
            return rolled_back

        rolled_back = await self.runner.call(run)
        if rolled_back is None:
            return False
        # NOTE: through the request's queue, behind every output the engine produced before
        # the extension, so outputs decoded ahead on the old path can't outlive the rollback.
        applied = asyncio.get_running_loop().create_future()
        state.queue.put_nowait(("extended", start, tuple(token_ids), rolled_back, applied))
        try:
            await asyncio.wait_for(applied, self.kv_timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{rid}: the extension was not applied in {self.kv_timeout_s} s"
            ) from None
        return True

    async def _apply_extension(
        self,
        state: _State,
        start: int,
        token_ids: tuple[int, ...],
        rolled_back: bool,
        applied: asyncio.Future,
    ) -> None:
        end = start + len(token_ids)
        for i, tok in enumerate(token_ids):
            state.outputs[start + i] = tok
            state.logprobs.pop(start + i, None)  # another stage's token now
        async with state.progress:
            if rolled_back:
                for pos in [p for p in state.outputs if p >= end]:
                    del state.outputs[pos]
                    state.logprobs.pop(pos, None)
                state.produced = end - 1
            else:
                state.produced = max(state.produced, end - 1)
            state.progress.notify_all()
        if not applied.done():
            applied.set_result(None)
