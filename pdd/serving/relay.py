"""RelayDecode's request life: fast-link KV → decode at once → hand over by token IDs.

Life of a request (one ``decode`` generator per request, opened by the gateway):
  1. ``add_request(paused)``; the relay waits for prefill to write the full KV
     over the fast link (RDMA, shared memory or TCP: ``FastLinkReceiver``);
  2. the KV is imported, prefill's first token appended, and decoding starts
     at once — every token streams to the gateway with its position;
  3. meanwhile ``WaitKvReady`` long-polls MainDecode; once MainDecode holds
     the KV, the handoff (``TokenHandoff``, token IDs only):
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
Cancellation (the gateway's call ends) aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from pdd.core.errors import DeadlineExceededError, InvalidArgumentError
from pdd.core.pipeline import HandoffMode
from pdd.core.stage_events import Accepted, Finished, HandedOff, RelayJob, Tokens
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.server.interceptors import outgoing_metadata
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import import_range
from pdd.serving.stream_pacer import StreamPacer, SwitchTimes
from pdd.telemetry import metrics
from pdd.wire.common import handoff_to_pb

log = structlog.get_logger(__name__)


# NOTE: the lead before a switch to that MainDecode was timed (learned from the first switch on):
# 1.5 × a typical switch on the testbed (two WAN hops, a step in flight and the extension step).
LEAD_PRIOR_S = 0.03


@dataclass(frozen=True)
class RelayConfig:
    kv_timeout_s: float = 60.0
    # How long a request that finished here waits for MainDecode to hold the KV.
    finished_handoff_timeout_s: float = 600.0
    # Catch-up stops once MainDecode is at most this many tokens behind.
    catch_up_gap: int = 8
    max_catch_up_rounds: int = 8
    # During a catch-up handoff the relay streams no faster than MainDecode decodes, holding a
    # token at most this long (``stream_pacer``); 0 turns pacing off.
    pace_max_hold_s: float = 0.05
    # The playout lead the relay's stream keeps behind its computation (``stream_pacer``):
    # None = what recent switches to the same MainDecode took (LEAD_PRIOR_S until one was
    # timed), 0 = none; never more than pace_max_hold_s.
    stream_lead_s: float | None = None

    def __post_init__(self) -> None:
        if self.stream_lead_s is not None and self.stream_lead_s < 0:
            raise ValueError(
                f"stream_lead_s: must be >= 0 or None (learned), got {self.stream_lead_s}"
            )
        if self.pace_max_hold_s < 0:
            raise ValueError(f"pace_max_hold_s: must be >= 0, got {self.pace_max_hold_s}")
        if self.catch_up_gap < 0:
            raise ValueError(f"catch_up_gap: must be >= 0, got {self.catch_up_gap}")
        if self.max_catch_up_rounds < 0:
            raise ValueError(f"max_catch_up_rounds: must be >= 0, got {self.max_catch_up_rounds}")


class Relay:
    def __init__(
        self,
        instance: EngineInstance,
        fast: FastLinkReceiver,
        channels: Channels,
        config: RelayConfig = RelayConfig(),
    ) -> None:
        self.instance = instance
        self.fast = fast
        self.channels = channels
        self.config = config
        self._active: set[str] = set()
        self._switch_times = SwitchTimes(LEAD_PRIOR_S)

    def _lead_s(self, job: RelayJob) -> float:
        if self.config.stream_lead_s is not None:
            return self.config.stream_lead_s
        return self._switch_times.lead_s((job.main_decode.address, job.handoff_mode))

    @property
    def runner(self):
        return self.instance.runner

    @property
    def engine(self):
        return self.instance.engine

    async def decode(
        self, job: RelayJob
    ) -> AsyncIterator[Accepted | Tokens | HandedOff | Finished]:
        rid = job.request_id
        if rid in self._active:
            raise InvalidArgumentError("request_id", f"{rid!r} is already decoding here")
        self._active.add(rid)
        queue = self.runner.open(rid)
        md = md_grpc.MainDecodeServiceStub(self.channels.get(job.main_decode.address))
        tasks: list[asyncio.Task] = []
        try:
            await self.runner.call(
                self.engine.add_request,
                rid,
                job.prompt_token_ids,
                job.sampling,
                salt=job.cache_salt,
                paused=True,
            )
            yield Accepted()
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
            # NOTE: the relay's share of TTFDT, logged with its first token: KV arrived → decoding → out.
            ttfdt_share: tuple[float, float] | None = (t_kv, time.perf_counter())
            pacer = StreamPacer(self.config.pace_max_hold_s, lead_s=self._lead_s(job))
            kv_ready = asyncio.create_task(self._wait_md(md, rid))
            tasks.append(kv_ready)
            kv_ready.add_done_callback(lambda t: queue.put_nowait(("kv_ready", t)))
            finished: tuple[str | None, int] | None = None
            outputs = list(
                first
            )  # NOTE: the engine forgets a finished request; keep its outputs here
            # NOTE: collected by a task of its own and stamped on arrival, also while the pacer
            # holds a token, so a held token is held from when it was computed.
            pending: collections.deque[tuple[float, object]] = collections.deque()
            arrived = asyncio.Event()

            async def collect() -> None:
                while True:
                    item = await queue.get()
                    pending.append((pacer.clock(), item))
                    if getattr(item, "finished", False):
                        pacer.release()  # NOTE: it ends here: no switch will come, nothing to hide
                    arrived.set()

            tasks.append(asyncio.create_task(collect()))
            while True:
                while not pending:
                    arrived.clear()
                    await arrived.wait()
                computed_at, item = pending.popleft()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple):
                    kind, value = item
                    if kind == "kv_ready" and finished is None:
                        interval_s = (
                            value.result()
                        )  # NOTE: surfaces MainDecode errors on this stream
                        if job.handoff_mode is HandoffMode.CATCH_UP:
                            pacer.pace(interval_s)
                        handoff = asyncio.create_task(self._handoff(md, job, queue, pacer))
                        tasks.append(handoff)
                        handoff.add_done_callback(
                            lambda t: t.cancelled()
                            or t.exception() is None
                            or queue.put_nowait(t.exception())
                        )
                    elif kind == "handed_off":
                        yield value
                        return
                    continue
                if item.token_id is not None and item.position >= len(first):
                    del outputs[item.position :]
                    outputs.append(item.token_id)
                    await pacer.hold(computed_at)
                    if ttfdt_share is not None:
                        arrived_at, started_at = ttfdt_share
                        log.info(
                            "relay_first_token",
                            import_ms=round((started_at - arrived_at) * 1000, 2),
                            first_token_ms=round((time.perf_counter() - arrived_at) * 1000, 2),
                        )
                        ttfdt_share = None
                    yield Tokens(
                        item.position,
                        (item.token_id,),
                        () if item.logprob is None else (item.logprob,),
                    )
                if item.finished and finished is None:
                    finished = (item.finish_reason, item.position + 1)
                    for t in tasks:
                        t.cancel()
                    await self._hand_over_finished(md, job, outputs[: item.position + 1])
                    yield Finished(*finished)
                    return
        finally:
            for t in tasks:
                t.cancel()
            self._active.discard(rid)
            self.runner.close(rid)
            self.fast.cancel(rid)
            self.runner.submit(
                self.engine.abort, rid
            )  # NOTE: not awaited: runs even when cancelled

    async def _wait_md(self, md, rid: str, timeout_s: float | None = None) -> float:
        """Wait until MainDecode holds the request's KV; returns its decode interval (s, 0 if unknown)."""
        deadline = time.monotonic() + (timeout_s or self.config.finished_handoff_timeout_s)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise DeadlineExceededError(f"main_decode did not receive the KV of {rid} in time")
            resp = await md.WaitKvReady(
                md_pb.WaitKvReadyRequest(request_id=rid, timeout_ms=min(left_ms, 30_000)),
                metadata=outgoing_metadata(),
            )
            if resp.ready:
                return resp.decode_interval_ms / 1000

    async def _handoff(self, md, job: RelayJob, queue: asyncio.Queue, pacer: StreamPacer) -> None:
        """Hand the request over; puts ("handed_off", HandedOff) on the request's queue.

        Releases ``pacer`` once MainDecode has acknowledged the final batch: it speaks next.
        """
        rid = job.request_id
        t0 = time.perf_counter()
        mode = job.handoff_mode
        rounds_left = self.config.max_catch_up_rounds if mode is HandoffMode.CATCH_UP else 0
        call = md.TokenHandoff(metadata=outgoing_metadata())
        sent = computed = rounds = 0
        try:
            while rounds_left > 0:
                outputs = await self.runner.call(self._read, rid)
                if outputs is None:
                    call.cancel()
                    return  # NOTE: it finished here meanwhile; decode() hands it over as finished
                # NOTE: MainDecode decodes ahead between rounds; what it computed needs no extend step.
                if len(outputs) - computed <= self.config.catch_up_gap:
                    break
                await call.write(
                    md_pb.TokenHandoffRequest(
                        request_id=rid,
                        start_position=sent,
                        token_ids=outputs[sent:],
                        mode=handoff_to_pb(mode),
                    )
                )
                ack = await call.read()
                sent, rounds, rounds_left = ack.extended_through, rounds + 1, rounds_left - 1
                computed = ack.computed_through
                pacer.pace(ack.decode_interval_ms / 1000)
            # NOTE: after pause returns, every output of the last step is already on the queue.
            outputs = await self.runner.call(self._pause_and_read, rid)
            if outputs is None:
                call.cancel()
                return
            t_final, lag_s = time.perf_counter(), pacer.lag_s
            await call.write(
                md_pb.TokenHandoffRequest(
                    request_id=rid,
                    start_position=sent,
                    token_ids=outputs[sent:],
                    final=True,
                    mode=handoff_to_pb(mode),
                )
            )
            await call.read()
            pacer.release()
            switch_s = time.perf_counter() - t_final
            self._switch_times.observe((job.main_decode.address, mode), switch_s)
            metrics.SWITCH_TIME.labels(mode.value).observe(switch_s)
            await call.done_writing()
        except grpc.aio.AioRpcError:
            call.cancel()
            raise
        rounds += 1
        metrics.HANDOFFS.labels(mode.value, "live").inc()
        metrics.HANDOFF_TIME.labels(mode.value).observe(time.perf_counter() - t0)
        log.info(
            "handed_off",
            at=len(outputs),
            mode=mode.value,
            rounds=rounds,
            switch_ms=round(switch_s * 1000, 2),
            lead_ms=round(pacer.lead_s * 1000, 2),
            lag_ms=round(lag_s * 1000, 2),
        )
        queue.put_nowait(
            ("handed_off", HandedOff(len(outputs), mode, rounds, (time.perf_counter() - t0) * 1000))
        )

    def _read(self, rid: str) -> list[int] | None:
        return self.engine.output_token_ids(rid) if self.engine.holds_request(rid) else None

    def _pause_and_read(self, rid: str) -> list[int] | None:
        if not self.engine.holds_request(rid):
            return None
        self.engine.pause(rid)
        return self.engine.output_token_ids(rid)

    async def _hand_over_finished(self, md, job: RelayJob, outputs: list[int]) -> None:
        """The request finished here first: MainDecode still gets every token for its DRC."""
        rid = job.request_id
        await self._wait_md(md, rid)
        call = md.TokenHandoff(metadata=outgoing_metadata())
        await call.write(
            md_pb.TokenHandoffRequest(
                request_id=rid,
                start_position=0,
                token_ids=outputs,
                final=True,
                request_finished=True,
                mode=handoff_to_pb(job.handoff_mode),
            )
        )
        await call.read()
        await call.done_writing()
        metrics.HANDOFFS.labels(job.handoff_mode.value, "finished").inc()
