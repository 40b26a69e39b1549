"""MainDecode's request life: DRC hit → KV delta → (handoff) → decode.

Life of a request (one ``decode`` generator per request, opened by the gateway):
  1. admit: ``add_request(paused)``: the prompt is matched against the DRC
     (the engine's radix cache of prompts *and* outputs); the hit is locked
     and reported — prefill pushes KV only from there on;
  2. receive KV: the pushed delta is reassembled by the ``KvReceiver``
     (chunks in any order, duplicates ignored, checksums checked) and imported; a push that
     is not the KV the request waits for is refused (``main_decode_guard``, as are handoff
     batches that leave a gap or rewrite an output already handed over);
  3. P-MD: prefill's first token is appended and decoding starts at once;
     P-RLD-MD: the relay hands over with ``handoff`` — token IDs only. Each
     batch is *extended* in one forward pass (``append_tokens``); MainDecode
     starts emitting at the final batch's end. A request that already
     finished upstream is extended into the DRC and emits nothing;
  MD (conditional disaggregation): no prefill stage and no push — the engine
     prefills the short uncached suffix in its own batch, samples position 0
     and MainDecode speaks from the first token;
  MD resume (a request migrated here after its MainDecode or prefill was lost): the job
     carries the outputs already streamed; they are appended as the request's outputs
     before it first runs (penalties and grammar follow them), the engine prefills
     prompt + those in its own batch and MainDecode speaks from the next position;
  P-RLD-MD resume (re-homed here while the relay streams on, its first MainDecode lost): the
     same local prefill, but silent: the KV counts as ready once it produced its first output
     (``wait_kv_ready``), it decodes ahead like a catch-up target, and speaks from the end of
     the handoff's final batch (the gateway's, taking the request from the relay);
  4. decode: every output is streamed with its position; finishing inserts
     prompt + output into the DRC (cache events reach kvstore), so the
     session's next turn hits here.
Cancellation (the gateway's call ends) aborts the request and frees its KV.

The request's queue carries the engine loop's items (``pdd.serving.mailbox``, ``StepOutput``)
and MainDecode's own: ``Extended`` (an extension to apply, in order behind the outputs the
engine produced before it), ``EmitFrom`` (where MainDecode starts speaking) and ``Failed``
(``main_decode_life``, with the request's record).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

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
from pdd.core.token_runs import coalesce
from pdd.engine.engine import StepOutput
from pdd.engine.protocol import EngineBackend
from pdd.engine.sampling import Logprob
from pdd.kv.receiver import KvReceiver, ReceivedKv
from pdd.kv.transfer import Commit, TransferHeader
from pdd.serving.admission import Admission, AdmissionConfig
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import import_range
from pdd.serving.mailbox import StepFailed
from pdd.serving.main_decode_guard import check_handoff, check_push
from pdd.serving.main_decode_life import DecodeLife, EmitFrom, Extended, Failed
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)

# How long a new call waits for a cancelled call of the same request id to be closed here
# (a migration may come back to this MainDecode right after cancelling its first call).
REPLACED_CALL_WAIT_S = 2.0


def _ends(events: list) -> bool:
    return any(isinstance(e, Finished) for e in events)


class MainDecode:
    def __init__(
        self,
        instance: EngineInstance,
        receiver: KvReceiver,
        *,
        kv_timeout_s: float = 600.0,
        admission: AdmissionConfig = AdmissionConfig(),
    ) -> None:
        """``admission``: the bounds of what decodes here at once (``pdd.serving.admission``)."""
        self.instance = instance
        self.receiver = receiver
        self.kv_timeout_s = kv_timeout_s
        self._requests: dict[str, DecodeLife] = {}
        self.admission = Admission.for_engine("main_decode", admission, lambda: self.engine)
        # NOTE: a push is refused unless it is the KV a request here waits for.
        receiver.check = self._check_push

    @property
    def runner(self):
        return self.instance.runner

    @property
    def engine(self) -> EngineBackend:
        """The engine, through its boundary only (``pdd.engine.protocol``): ours or vLLM's."""
        assert self.instance.engine is not None, "EngineInstance.start() was not awaited"
        return self.instance.engine

    async def decode(self, job: DecodeJob) -> AsyncIterator[Accepted | Tokens | Finished]:
        state = await self._open(job)  # NOTE: waits for a replaced call to release its place
        done = False
        kv_task: asyncio.Task | None = None
        ticket = None
        try:
            # NOTE: before any work; MainDecode holds prompt + every output (a resumed one too).
            ticket = self.admission.admit(
                job.request_id, len(job.prompt_token_ids) + job.sampling.max_tokens
            )
            yield Accepted(await self._admit(state))
            kv_task = self._start_kv(state)
            while not done:
                events = await self._on_item(state, await state.queue.get())
                # NOTE: what is already queued goes out with it, its tokens in one message: a
                # stream behind its engine's steps catches up in one write, not one per token.
                while not state.queue.empty() and not _ends(events):
                    events += await self._on_item(state, state.queue.get_nowait())
                for event in coalesce(events):
                    done = done or isinstance(event, Finished)
                    yield event
        finally:
            if ticket is not None:
                ticket.release()
            self._close(state, kv_task, done=done)

    # --- the steps of a request's life --------------------------------------------------------

    async def _open(self, job: DecodeJob) -> DecodeLife:
        rid = job.request_id
        if (old := self._requests.get(rid)) is not None:
            # NOTE: a migrated request may come back here just after the gateway cancelled its
            # first call, before that call's cancellation reached this process.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.closed.wait(), REPLACED_CALL_WAIT_S)
        if rid in self._requests:
            raise InvalidArgumentError("request_id", f"{rid!r} is already decoding here")
        state = DecodeLife(job, self.runner.open(rid))
        self._requests[rid] = state
        return state

    async def _admit(self, state: DecodeLife) -> int:
        """Add the request (paused unless MD prefills it here); how many prompt tokens it hit.
        A resumed MD request is added paused, given its outputs so far, then resumed: its first
        step computes prompt + those outputs and samples the next position."""
        job = state.job
        rid = job.request_id
        local = job.pipeline is Pipeline.MD
        resume = list(job.resume_token_ids)

        def admit() -> int:
            self.engine.add_request(
                rid,
                job.prompt_token_ids,
                job.sampling,
                salt=job.cache_salt,
                paused=not local or bool(resume),
            )
            cached = self.engine.num_cached_tokens(rid)
            if resume:
                self.engine.append_tokens(rid, resume, 0)
                self.engine.resume(rid)
            return cached

        if local:
            self.runner.expect(job.burst_following)
        cached = await self.runner.call(admit)
        state.outputs.update(enumerate(resume))
        state.produced = len(resume) - 1
        state.cached_tokens, state.handed = cached, len(resume)
        metrics.PREFIX_QUERIES.labels("main_decode").inc(len(job.prompt_token_ids))
        metrics.PREFIX_HITS.labels("main_decode").inc(cached)
        log.info(
            "md_accepted",
            cached_tokens=cached,
            prompt_tokens=len(job.prompt_token_ids),
            resumed_at=len(resume),
        )
        return cached

    def _start_kv(self, state: DecodeLife) -> asyncio.Task | None:
        """Start receiving the KV delta; MD has none and speaks from its first new output (0, or
        the end of the outputs it resumed from)."""
        if state.job.pipeline is Pipeline.MD:
            state.kv_ready.set()  # NOTE: nothing to receive: a stray handoff must not wait for KV
            state.emit_from = len(state.job.resume_token_ids)
            return None
        if state.job.resume_token_ids:
            return None  # NOTE: re-homed P-RLD-MD: the KV is rebuilt here (``_on_output``)
        return asyncio.create_task(self._receive_kv(state))

    async def _on_item(self, state: DecodeLife, item: object) -> list[Tokens | Finished]:
        """Apply one mailbox item; the events it lets MainDecode send."""
        match item:
            case StepOutput():
                return await self._on_output(state, item)
            case Extended():
                await self._apply_extension(state, item)
                return []
            case EmitFrom(position=position):
                return self._on_emit_from(state, position)
            case Failed(error=error) | StepFailed(error=error):
                raise error
        raise TypeError(f"unexpected item on {state.job.request_id}'s queue: {item!r}")

    async def _on_output(self, state: DecodeLife, out: StepOutput) -> list[Tokens | Finished]:
        await self._note(state, out)
        if not state.kv_ready.is_set():
            state.kv_ready.set()  # NOTE: a re-homed request's local prefill is done
        events: list[Tokens | Finished] = []
        if out.token_id is not None and state.emit_from is not None:
            if out.position >= state.emit_from:
                state.md_tokens += 1
                logprobs = self._logprobs(state, [out.position])
                # NOTE: prompt logprobs come with the first output of a prompt prefilled here (MD)
                prompt = out.prompt_logprobs or ()
                events.append(Tokens(out.position, (out.token_id,), logprobs, prompt))
        if out.finished:
            state.finish_reason = out.finish_reason
            if state.emit_from is not None:
                events.append(self._finished(state, out.finish_reason))
        return events

    def _on_emit_from(self, state: DecodeLife, position: int) -> list[Tokens | Finished]:
        state.emit_from = position
        events: list[Tokens | Finished] = []
        ready = sorted(p for p in state.outputs if p >= position)
        if ready:
            state.md_tokens += len(ready)
            tokens = tuple(state.outputs[p] for p in ready)
            events.append(Tokens(ready[0], tokens, self._logprobs(state, ready)))
        if state.finished:
            events.append(self._finished(state, state.finish_reason))
        return events

    def _close(self, state: DecodeLife, kv_task: asyncio.Task | None, *, done: bool) -> None:
        rid = state.job.request_id
        if kv_task is not None:
            kv_task.cancel()
        if self._requests.get(rid) is state:
            del self._requests[rid]
        state.closed.set()
        self.runner.close(rid)
        if not done:
            self.receiver.discard(rid)
            self.runner.submit(
                self.engine.abort, rid
            )  # NOTE: not awaited: runs even when cancelled
            log.info("md_request_aborted")

    @staticmethod
    def _logprobs(state: DecodeLife, positions: list[int]) -> tuple[Logprob, ...]:
        if state.job.sampling.logprobs is None:
            return ()
        missing = [p for p in positions if p not in state.logprobs]
        if missing:  # NOTE: MainDecode speaks only from where it sampled; anything else is a bug
            raise FailedPreconditionError(
                f"no logprobs for outputs {missing[:5]} of {state.job.request_id}"
            )
        return tuple(state.logprobs[p] for p in positions)

    @staticmethod
    def _finished(state: DecodeLife, reason: str | None) -> Finished:
        return Finished(
            reason,
            max(state.outputs, default=-1) + 1,
            state.md_tokens,
            state.wan_bytes,
            state.extend_s * 1000,
        )

    async def _note(self, state: DecodeLife, out: StepOutput) -> None:
        if out.token_id is not None:
            state.outputs[out.position] = out.token_id
            if out.logprob is not None:
                state.logprobs[out.position] = out.logprob
        async with state.progress:
            state.produced = max(state.produced, out.position)
            state.finished = state.finished or out.finished
            state.progress.notify_all()

    # --- the KV delta ---------------------------------------------------------------------------

    def _check_push(self, item: TransferHeader | Commit) -> None:
        check_push(self._requests.get(item.request_id), item, self.engine.model_config)

    async def _receive_kv(self, state: DecodeLife) -> None:
        try:
            kv = await self.receiver.wait_complete(state.job.request_id, self.kv_timeout_s)
            if state.job.pipeline is Pipeline.P_MD:
                await self._start_from_first(state, kv)
            else:
                t0 = time.perf_counter()
                await self.runner.call(self._import_range, state, kv)
                self._imported(state, kv, t0)
        except Exception as exc:  # noqa: BLE001 — surfaced on the request's stream
            state.queue.put_nowait(Failed(exc))

    def _import_range(self, state: DecodeLife, kv: ReceivedKv) -> None:
        """On the engine thread: write the received range into the request's KV."""
        import_range(self.engine, state.job.request_id, kv.header, kv.payload)

    def _imported(self, state: DecodeLife, kv: ReceivedKv, t0: float) -> None:
        rid = state.job.request_id
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

    async def _start_from_first(self, state: DecodeLife, kv: ReceivedKv) -> None:
        """P-MD: import the prompt's KV, append prefill's first token(s), speak from the next
        output.

        NOTE: the import and the append are one engine call: each call waits for the step in
        progress, and a burst's imports land while MainDecode steps the requests already in."""
        first = list(kv.output_token_ids)
        t0 = time.perf_counter()
        # NOTE: expedited: the client waits on this first decode step (TTFDT).
        if not await self._append(
            state, 0, first, expedite=True, before=lambda: self._import_range(state, kv)
        ):
            self.receiver.pop(state.job.request_id)  # NOTE: gone meanwhile: nothing imported
            return
        self._imported(state, kv, t0)
        state.extend_s += time.perf_counter() - t0
        state.queue.put_nowait(EmitFrom(len(first)))

    # --- the handoff (relay or gateway → here) --------------------------------------------------

    @property
    def decode_interval_s(self) -> float:
        """Recent time between this engine's decode steps (0 until measured): the relay paces to it."""
        return self.runner.step_interval_s

    async def wait_kv_ready(self, request_id: str, timeout_ms: int) -> KvReadiness:
        """Long-poll (at most ``timeout_ms``) until this MainDecode holds the request's KV."""
        state = self._requests.get(request_id)
        if state is None:
            raise NotFoundError(f"request_id: {request_id!r} is not decoding here")
        ready, closed = (
            asyncio.ensure_future(state.kv_ready.wait()),
            asyncio.ensure_future(state.closed.wait()),
        )
        try:
            await asyncio.wait(
                (ready, closed), timeout=timeout_ms / 1000, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            closed.cancel()
        # NOTE: a call closed meanwhile (the gateway moved the request) must not be waited on:
        # a relay polling it learns at once that this MainDecode no longer has the request.
        if state.closed.is_set():
            raise NotFoundError(f"request_id: {request_id!r} is no longer decoding here")
        return KvReadiness(state.kv_ready.is_set(), self.decode_interval_s * 1000)

    async def handoff(self, batch: HandoffBatch) -> HandoffAck:
        """Extend one handoff batch (see ``_extend_handoff``) and acknowledge it."""
        t0 = time.perf_counter()
        state = await self._handoff_state(batch.request_id)
        async with state.handoff_lock:
            through, computed = await self._extend_handoff(
                state, batch.start_position, list(batch.token_ids), final=batch.final
            )
        return HandoffAck(
            through, computed, (time.perf_counter() - t0) * 1000, self.decode_interval_s * 1000
        )

    async def _extend_handoff(
        self, state: DecodeLife, start: int, token_ids: list[int], *, final: bool
    ) -> tuple[int, int]:
        """Extend ``token_ids`` at output ``start``.

        Returns (outputs extended through, outputs computed here). Between rounds
        MainDecode keeps decoding *ahead* of the relay (its tokens equal the
        relay's for greedy and seeded sampling), so a round whose tokens it
        already computed costs no engine step: the final one then lets MainDecode
        speak at once instead of after an extend step.
        """
        request_id = state.job.request_id
        target = start + len(token_ids)
        if check_handoff(state, start, token_ids):
            return target, max(target, state.produced + 1)  # a retransmit after the final batch
        agrees = state.agrees(start, token_ids)
        if state.finished:
            # NOTE: MainDecode ran ahead to the end during catch-up; it must agree with the relay.
            if not agrees:
                raise FailedPreconditionError(
                    f"token_ids: disagree with {request_id}'s finished outputs"
                )
        elif not (agrees and state.produced >= target):
            await self._extend(state, start, token_ids, final=final)
        state.handed = max(state.handed, target)
        if final:
            state.handoff_end = target
            state.queue.put_nowait(EmitFrom(target))
        return target, max(target, state.produced + 1)

    async def _handoff_state(self, request_id: str) -> DecodeLife:
        """The P-RLD-MD request being handed over, once its KV is here."""
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
        return state

    async def _extend(
        self, state: DecodeLife, start: int, token_ids: list[int], *, final: bool
    ) -> None:
        """Append a handoff batch and wait until the engine computed it (or finished)."""
        target = start + len(token_ids)
        t0 = time.perf_counter()
        appended = await self._append(state, start, token_ids, expedite=final)
        async with state.progress:
            # The extension is computed once the engine produced the position after it (or finished).
            await state.progress.wait_for(lambda: state.produced >= target or state.finished)
        if not appended and not state.agrees(start, token_ids):
            # NOTE: MainDecode finished ahead while this round was on its way: its outputs stand
            # and must agree with the relay's, or the stream would mix two paths.
            raise FailedPreconditionError(
                f"token_ids: disagree with {state.job.request_id}'s finished outputs"
            )
        state.extend_s += time.perf_counter() - t0

    async def _append(
        self,
        state: DecodeLife,
        start: int,
        token_ids: list[int],
        *,
        expedite: bool,
        before: Callable[[], None] | None = None,
    ) -> bool:
        """Make ``token_ids`` the outputs from ``start`` (extend: computed in one pass); what
        MainDecode decoded ahead is kept where it agrees and dropped from the first disagreement.

        ``expedite``: the client is waiting on this extension (the relay has stopped, or it is
        P-MD's first decode step), so it gets an engine step of its own. ``before``: run first, in
        the same engine call (P-MD's import). False when the engine no longer holds the request
        (it finished, or was aborted): nothing was appended.
        """
        rid = state.job.request_id

        def run() -> bool | None:
            if not self.engine.holds_request(rid):
                return None
            if before is not None:
                before()
            try:
                rolled_back = self.engine.append_tokens(rid, token_ids, start)
            except ValueError as exc:
                # NOTE: a batch this request's outputs cannot take (ahead of what MainDecode
                # holds, beyond max_tokens, past a stop): the batch is refused, the request
                # and its KV stay as they were for the relay's next (right) batch.
                field = "start_position" if str(exc).startswith("start") else "token_ids"
                raise FailedPreconditionError(f"{field}: {exc} (handoff of {rid})") from None
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
        state.queue.put_nowait(Extended(start, tuple(token_ids), rolled_back, applied))
        try:
            await asyncio.wait_for(applied, self.kv_timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{rid}: the extension was not applied in {self.kv_timeout_s} s"
            ) from None
        return True

    async def _apply_extension(self, state: DecodeLife, ext: Extended) -> None:
        end = ext.start + len(ext.token_ids)
        for i, tok in enumerate(ext.token_ids):
            state.outputs[ext.start + i] = tok
            state.logprobs.pop(ext.start + i, None)  # another stage's token now
        async with state.progress:
            if ext.rolled_back:
                for pos in [p for p in state.outputs if p >= end]:
                    del state.outputs[pos]
                    state.logprobs.pop(pos, None)
                state.produced = end - 1
            else:
                state.produced = max(state.produced, end - 1)
            state.progress.notify_all()
        if not ext.applied.done():
            ext.applied.set_result(None)
