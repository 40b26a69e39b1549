"""RelayDecode's request life: fast-link KV → decode at once → hand over by token IDs.

Life of a request (one ``decode`` generator per request, opened by the gateway):
  1. ``add_request(paused)``; the relay waits for prefill to write the full KV
     over the fast link (RDMA, shared memory or TCP: ``FastLinkReceiver``);
  2. the KV is imported, prefill's first token appended, and decoding starts
     at once — every token streams to the gateway with its position;
  3. meanwhile ``wait_kv_ready`` long-polls MainDecode; once MainDecode holds
     the KV, the handoff (``token_handoff``, token IDs only):
     - one-shot: pause, send every output, stop;
     - catch-up: send what exists while still decoding; MainDecode extends
       it and keeps decoding ahead; repeat with the newer tokens until
       MainDecode's computed frontier is close, then pause and send the rest
       as the final batch (the tokens MainDecode already computed cost it no
       step, so it speaks at once); meanwhile the relay streams no faster
       than MainDecode decodes and lets held tokens go once MainDecode has
       the final batch (``stream_pacer``), so a lead shows as no stall;
     from its first token the relay streams a small playout lead behind its
     computation (what recent switches took), so the switch itself shows as
     no stall either;
     the relay then frees the request's KV at once;
  4. a request that finishes here first still hands its final tokens over
     (``request_finished``), so MainDecode's DRC holds prompt + output.
MainDecode lost (its KV wait or the handoff fails with the peer gone: ``PeerError.lost``): the
relay decodes on alone — a fault path, logged and counted, never planned — streaming every
token; the gateway re-homes the request on another MainDecode and takes it from the relay once
that one has rebuilt the KV, or, with none left, the relay finishes the request itself.
Cancellation (the gateway's call ends) aborts the request and frees its KV.

The request's mailbox (its engine-loop queue) holds the engine's ``StepOutput``s and
``StepFailed``, and the relay's own ``KvReady``, ``HandoffDone`` and ``Failed``
(``pdd.serving.relay_life``, with the request's record). MainDecode is a peer
(``MainDecodePeer``): a ``MainDecodeClient`` over gRPC, or an in-process one in tests.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import structlog

from pdd.core.errors import DeadlineExceededError, InvalidArgumentError, PeerError
from pdd.core.instance import InstanceRef
from pdd.core.pipeline import HandoffMode
from pdd.core.stage_events import (
    Accepted,
    Finished,
    HandedOff,
    RelayEvent,
    RelayJob,
    Tokens,
)
from pdd.engine.engine import StepOutput
from pdd.engine.protocol import EngineBackend
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.serving.admission import Admission, AdmissionConfig
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import import_range
from pdd.serving.mailbox import StepFailed
from pdd.serving.relay_life import (
    LEAD_PRIOR_S,
    Failed,
    HandoffDone,
    HandoffStream,
    KvReady,
    MainDecodePeer,
    RelayConfig,
    RelayLife,
    handoff_batch,
    post_outcome,
)
from pdd.serving.stream_pacer import StreamPacer, SwitchTimes
from pdd.telemetry import metrics
from pdd.wire.main_decode_client import MainDecodeClient

log = structlog.get_logger(__name__)

# The first wait before asking a MainDecode that did not know the request yet again (doubling
# up to 0.2 s while its grace lasts).
UNKNOWN_RETRY_S = 0.01


class Relay:
    def __init__(
        self,
        instance: EngineInstance,
        fast: FastLinkReceiver,
        channels: Channels,
        config: RelayConfig = RelayConfig(),
        *,
        main_decode: Callable[[InstanceRef], MainDecodePeer] | None = None,
        admission: AdmissionConfig = AdmissionConfig(),
    ) -> None:
        """``main_decode``: the peer a request's MainDecode is reached through (default: a
        ``MainDecodeClient`` on ``channels``; tests pass an in-process one). ``admission``: the
        bounds of what decodes here at once (``pdd.serving.admission``)."""
        self.instance = instance
        self.fast = fast
        self.channels = channels
        self.config = config
        self._main_decode = main_decode or (lambda ref: MainDecodeClient(channels.get(ref.address)))
        self._active: set[str] = set()
        self._switch_times = SwitchTimes(LEAD_PRIOR_S)
        self.admission = Admission.for_engine("relay", admission, lambda: self.engine)

    def _lead_s(self, job: RelayJob) -> float:
        if self.config.stream_lead_s is not None:
            return self.config.stream_lead_s
        return self._switch_times.lead_s((job.main_decode.address, job.handoff_mode))

    # NOTE: the instance builds its engine and loop in start(): read them when used.
    @property
    def runner(self):
        return self.instance.runner

    @property
    def engine(self) -> EngineBackend:
        """The engine, through its boundary only (``pdd.engine.protocol``): ours or vLLM's."""
        assert self.instance.engine is not None, "EngineInstance.start() was not awaited"
        return self.instance.engine

    async def decode(self, job: RelayJob) -> AsyncIterator[RelayEvent]:
        rid = job.request_id
        if rid in self._active:
            raise InvalidArgumentError("request_id", f"{rid!r} is already decoding here")
        # NOTE: before any work; the relay may hold prompt + every output until the handoff.
        ticket = self.admission.admit(rid, len(job.prompt_token_ids) + job.sampling.max_tokens)
        self._active.add(rid)
        life = RelayLife(job, self.runner.open(rid), self._main_decode(job.main_decode))
        try:
            await self._admit(job)
            yield Accepted()
            if job.resume_token_ids:
                await self._start_resumed(life)
            else:
                await self._start(life)
                self._spawn(life, self._wait_kv(life))
            life.tasks.append(asyncio.create_task(self._collect(life)))
            while True:
                computed_at, item = await self._next(life)
                match item:
                    case StepOutput():
                        if (tokens := await self._stream(life, computed_at, item)) is not None:
                            yield tokens
                        if item.finished:
                            yield await self._finish_here(life, item)
                            return
                    case KvReady(interval_s=interval_s):
                        self._begin_handoff(life, interval_s)
                    case HandoffDone(handed_off=handed_off):
                        yield handed_off
                        return
                    case Failed(error=PeerError() as error) if error.lost:
                        await self._go_alone(life, error)
                    case Failed(error=error) | StepFailed(error=error):
                        raise error  # NOTE: surfaces MainDecode's errors on this stream
                    case _:
                        raise TypeError(f"relay mailbox: unexpected item {item!r}")
        finally:
            ticket.release()
            self._clean_up(life)

    async def _admit(self, job: RelayJob) -> None:
        await self.runner.call(
            self.engine.add_request,
            job.request_id,
            job.prompt_token_ids,
            job.sampling,
            salt=job.cache_salt,
            paused=True,
        )

    async def _start(self, life: RelayLife) -> None:
        """Wait for prefill's KV on the fast link, import it, append the first token, decode."""
        rid = life.job.request_id
        region = await self.fast.wait_complete(rid, self.config.kv_timeout_s)
        t_kv = time.perf_counter()
        try:
            await self.runner.call(import_range, self.engine, rid, region.header, region.view)
        finally:
            self.fast.release(region.transfer_id)
        first = list(region.output_token_ids)

        def start() -> None:
            self.engine.append_tokens(rid, first, 0)
            self.engine.resume(rid)

        await self.runner.call(start)
        life.ttfdt_share = (t_kv, time.perf_counter())
        life.pacer = StreamPacer(self.config.pace_max_hold_s, lead_s=self._lead_s(life.job))
        life.own_from = len(first)
        life.outputs = first

    async def _start_resumed(self, life: RelayLife) -> None:
        """A request re-routed here mid-stream: prefill prompt + the outputs streamed, locally
        (penalties and grammar follow them), and decode on alone from the next position."""
        rid, resume = life.job.request_id, list(life.job.resume_token_ids)

        def start() -> None:
            self.engine.append_tokens(rid, resume, 0)
            self.engine.resume(rid)

        await self.runner.call(start)
        life.pacer = StreamPacer(self.config.pace_max_hold_s, lead_s=0.0)
        life.pacer.release()  # NOTE: no switch will come: nothing to hide
        life.own_from, life.outputs, life.alone = len(resume), resume, True
        metrics.RELAY_ALONE.labels("rerouted").inc()
        log.warning("relay_resumed", at=len(resume))

    def _spawn(self, life: RelayLife, work: Coroutine[Any, Any, object]) -> None:
        """Run ``work`` beside the stream; its result (a mailbox item, or None) or error is mail."""
        task = asyncio.create_task(work)
        life.tasks.append(task)
        task.add_done_callback(functools.partial(post_outcome, life.mailbox))

    async def _collect(self, life: RelayLife) -> None:
        """Move the mailbox to ``pending``, each item stamped with when it arrived."""
        while True:
            item = await life.mailbox.get()
            life.pending.append((life.pacer.clock(), item))
            if isinstance(item, StepOutput) and item.finished:
                life.pacer.release()  # NOTE: it ends here: no switch will come, nothing to hide
            life.arrived.set()

    @staticmethod
    async def _next(life: RelayLife) -> tuple[float, object]:
        while not life.pending:
            life.arrived.clear()
            await life.arrived.wait()
        return life.pending.popleft()

    async def _stream(self, life: RelayLife, computed_at: float, out: StepOutput) -> Tokens | None:
        """The relay's token ``out``, once the pacer lets it leave (None: not one of its own)."""
        if out.token_id is None or out.position < life.own_from:
            return None
        del life.outputs[out.position :]
        life.outputs.append(out.token_id)
        await life.pacer.hold(computed_at)
        if life.ttfdt_share is not None:
            arrived_at, started_at = life.ttfdt_share
            log.info(
                "relay_first_token",
                import_ms=round((started_at - arrived_at) * 1000, 2),
                first_token_ms=round((time.perf_counter() - arrived_at) * 1000, 2),
            )
            life.ttfdt_share = None
        return Tokens(out.position, (out.token_id,), () if out.logprob is None else (out.logprob,))

    async def _finish_here(self, life: RelayLife, out: StepOutput) -> Finished:
        """The request finished here first: MainDecode still gets every token for its DRC
        (unless it was lost: then the relay finished the request alone)."""
        for task in life.tasks:
            task.cancel()
        job = life.job
        finished = Finished(out.finish_reason, out.position + 1)
        if not life.alone:
            try:
                await self._wait_md(life)
                call = life.md.token_handoff()
                outputs = life.outputs[: out.position + 1]
                try:
                    batch = handoff_batch(job, outputs, 0, final=True, request_finished=True)
                    await call.send(batch)
                    await call.done()
                except BaseException:
                    call.cancel()  # NOTE: as in _handoff: never leave the call open
                    raise
                metrics.HANDOFFS.labels(job.handoff_mode.value, "finished").inc()
                return finished
            except PeerError as exc:
                if not exc.lost:
                    raise
                await self._go_alone(life, exc)
        metrics.RELAY_ALONE.labels("finished").inc()
        log.warning("relay_finished_alone", completion_tokens=out.position + 1)
        return replace(finished, alone=True)

    async def _go_alone(self, life: RelayLife, error: PeerError) -> None:
        """MainDecode is lost: decode on (resumed, if the handoff had paused it), unpaced."""
        if life.alone:
            return
        life.alone = True
        metrics.RELAY_ALONE.labels("main_decode_lost").inc()
        log.warning(
            "relay_main_decode_lost",
            main_decode=life.job.main_decode.instance_id,
            at=len(life.outputs),
            error=str(error)[:200],
        )
        life.pacer.release()  # NOTE: no switch is coming: nothing to hide, nothing to pace to
        await self.runner.call(self._resume_alone, life.job.request_id)

    def _resume_alone(self, rid: str) -> None:
        if self.engine.holds_request(rid):
            self.engine.resume(rid)

    async def _wait_md(self, life: RelayLife) -> float:
        """Wait until MainDecode holds the request's KV; returns its decode interval (s, 0 if
        unknown)."""
        rid = life.job.request_id
        deadline = time.monotonic() + self.config.finished_handoff_timeout_s
        grace_until = life.admitted_at + self.config.main_decode_grace_s
        retry_s = UNKNOWN_RETRY_S
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise DeadlineExceededError(f"main_decode did not receive the KV of {rid} in time")
            try:
                readiness = await life.md.wait_kv_ready(rid, min(left_ms, 30_000))
            except PeerError as exc:
                # NOTE: not there yet, not lost: its call may still be on the WAN (the gateway
                # does not wait for it before prefill, so this relay may have its KV first).
                if exc.code != "NOT_FOUND" or time.monotonic() >= grace_until:
                    raise
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, 0.2)
                continue
            if readiness.ready:
                return readiness.decode_interval_ms / 1000

    async def _wait_kv(self, life: RelayLife) -> KvReady:
        return KvReady(await self._wait_md(life))

    def _begin_handoff(self, life: RelayLife, interval_s: float) -> None:
        """MainDecode holds the KV: hand the request over beside the stream."""
        if life.job.handoff_mode is HandoffMode.CATCH_UP:
            life.pacer.pace(interval_s)
        self._spawn(life, self._handoff(life))

    async def _handoff(self, life: RelayLife) -> HandoffDone | None:
        """Hand the request over (None: it finished here meanwhile; ``decode`` hands it over as
        finished). Releases the pacer once MainDecode has acknowledged the final batch: it
        speaks next."""
        t0 = time.perf_counter()
        call = life.md.token_handoff()
        try:
            caught_up = await self._catch_up(life, call)
            final = None if caught_up is None else await self._send_final(life, call, caught_up[0])
            if caught_up is None or final is None:
                call.cancel()
                return None  # NOTE: it finished here meanwhile; decode() hands it over as finished
            await call.done()
        except BaseException:
            # NOTE: a failed handoff, and the request's own cancellation (its client went away
            # mid-handoff): an open call would keep MainDecode's handler and ours alive forever.
            call.cancel()
            raise
        return self._handed_off(life, t0, caught_up[1] + 1, *final)

    async def _catch_up(self, life: RelayLife, call: HandoffStream) -> tuple[int, int] | None:
        """The catch-up rounds (none one-shot): (outputs sent, rounds), None if it finished."""
        job = life.job
        rounds_left = (
            self.config.max_catch_up_rounds if job.handoff_mode is HandoffMode.CATCH_UP else 0
        )
        sent = computed = rounds = 0
        while rounds_left > 0:
            outputs = await self.runner.call(self._read, job.request_id)
            if outputs is None:
                return None
            # NOTE: MainDecode decodes ahead between rounds; what it computed needs no extend step.
            if len(outputs) - computed <= self.config.catch_up_gap:
                break
            ack = await call.send(handoff_batch(job, outputs, sent))
            sent, rounds, rounds_left = ack.extended_through, rounds + 1, rounds_left - 1
            computed = ack.computed_through
            life.pacer.pace(ack.decode_interval_ms / 1000)
        return sent, rounds

    async def _send_final(
        self, life: RelayLife, call: HandoffStream, sent: int
    ) -> tuple[int, float, float] | None:
        """Pause, send the rest as the final batch: (outputs handed over, switch s, lag s), None
        if it finished here meanwhile."""
        job = life.job
        # NOTE: after pause returns, every output of the last step is already on the queue.
        outputs = await self.runner.call(self._pause_and_read, job.request_id)
        if outputs is None:
            return None
        t_final, lag_s = time.perf_counter(), life.pacer.lag_s
        await call.send(handoff_batch(job, outputs, sent, final=True))
        life.pacer.release()
        switch_s = time.perf_counter() - t_final
        self._switch_times.observe((job.main_decode.address, job.handoff_mode), switch_s)
        metrics.SWITCH_TIME.labels(job.handoff_mode.value).observe(switch_s)
        return len(outputs), switch_s, lag_s

    def _handed_off(
        self, life: RelayLife, t0: float, rounds: int, at: int, switch_s: float, lag_s: float
    ) -> HandoffDone:
        mode = life.job.handoff_mode
        metrics.HANDOFFS.labels(mode.value, "live").inc()
        metrics.HANDOFF_TIME.labels(mode.value).observe(time.perf_counter() - t0)
        log.info(
            "handed_off",
            at=at,
            mode=mode.value,
            rounds=rounds,
            switch_ms=round(switch_s * 1000, 2),
            lead_ms=round(life.pacer.lead_s * 1000, 2),
            lag_ms=round(lag_s * 1000, 2),
        )
        return HandoffDone(HandedOff(at, mode, rounds, (time.perf_counter() - t0) * 1000))

    def _read(self, rid: str) -> list[int] | None:
        return self.engine.output_token_ids(rid) if self.engine.holds_request(rid) else None

    def _pause_and_read(self, rid: str) -> list[int] | None:
        if not self.engine.holds_request(rid):
            return None
        self.engine.pause(rid)
        return self.engine.output_token_ids(rid)

    def _clean_up(self, life: RelayLife) -> None:
        rid = life.job.request_id
        for task in life.tasks:
            task.cancel()
        self._active.discard(rid)
        self.runner.close(rid)
        self.fast.cancel(rid)
        self.runner.submit(self.engine.abort, rid)  # NOTE: not awaited: runs even when cancelled
