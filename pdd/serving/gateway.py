"""The gateway's request life: predict, route, fan out, merge one stream.

Life of a request:
  1. kvstore: live instances + predicted prefix hits of the prompt;
  2. router (pure policy): pipeline MD, P-MD or P-RLD-MD, the instances, the
     handoff mode;
  3. main_decode.Decode is opened: MainDecode matches the prompt in its
     DRC and *locks* the hit, answering how many tokens it holds — so the
     push can start exactly there and nothing is evicted meanwhile;
  4. P-RLD-MD: relay.Decode is opened at the same time (the relay waits for
     its KV); both accept before prefill is called;
  5. prefill.Prefill (not for MD, where MainDecode prefills the short
     uncached suffix itself): the first token comes back as soon as it is sampled
     (it is output position 0), KV flows to the relay (fast link) and the
     delta to MainDecode (WAN);
  6. relay and main_decode token deltas are merged by output position —
     duplicates dropped, gaps buffered — into one unbroken stream; the relay
     says where it handed over, MainDecode continues from there (if the relay
     dies first, the gateway hands MainDecode the tokens streamed so far itself);
  7. the final message carries finish reason and measured stats.
A client that goes away cancels every call, and each service frees the
request's KV when its call is cancelled.

Each stage's stream is read by its own task into the request's queue (``StageEvent``,
``StageFailed``, ``StageEnded``); the merge reads the queue, so the peers are typed clients
(``pdd.wire``) or, in tests, in-process fakes with the same methods (``peers=``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from pdd.core.errors import FailedPreconditionError, PeerError, UnavailableError
from pdd.core.instance import Instance
from pdd.core.pipeline import Pipeline, Stage
from pdd.core.request import Ending, FinalEvent, GenerateJob, RequestStats, TokenEvent
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import (
    Accepted,
    DecodeEvent,
    DecodeJob,
    Finished,
    FirstToken,
    HandedOff,
    HandoffBatch,
    PrefillEvent,
    PrefillJob,
    RelayEvent,
    RelayJob,
    Tokens,
    TransferDone,
)
from pdd.routing.policy import NoInstanceError, Route, RoutingConfig, route
from pdd.server.tls import TlsConfig
from pdd.serving.channels import Channels
from pdd.serving.token_merge import TokenMerge
from pdd.telemetry.metrics import HANDOFFS, RequestTracker
from pdd.wire.call import EventStream
from pdd.wire.kvstore_client import KvstoreClient
from pdd.wire.main_decode_client import MainDecodeClient
from pdd.wire.prefill_client import PrefillClient
from pdd.wire.relay_client import RelayClient

log = structlog.get_logger(__name__)


# --- the request's queue: what each stage's reader task says --------------------------------


@dataclass(frozen=True)
class StageEvent:
    """One event of a stage's stream, as the peer client read it."""

    stage: Stage
    event: PrefillEvent | RelayEvent | DecodeEvent


@dataclass(frozen=True)
class StageFailed:
    """A stage's stream broke (its call was not cancelled by us)."""

    stage: Stage
    error: Exception


@dataclass(frozen=True)
class StageEnded:
    """A stage's stream is over (after its last event, or after ``StageFailed``)."""

    stage: Stage


StageItem = StageEvent | StageFailed | StageEnded


# --- the peers ----------------------------------------------------------------------------------


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Peers(Protocol):
    """Where the gateway's peers come from: a client per call (``GrpcPeers``; tests: fakes)."""

    def kvstore(self) -> KvstoreClient: ...
    def prefill(self, address: str) -> PrefillClient: ...
    def relay(self, address: str) -> RelayClient: ...
    def main_decode(self, address: str) -> MainDecodeClient: ...
    async def close(self) -> None: ...


class GrpcPeers:
    """The gateway's peers as typed gRPC clients, on one long-lived channel per address."""

    def __init__(self, channels: Channels, kvstore_address: str, stage_timeout_s: float) -> None:
        self.channels = channels
        self.kvstore_address = kvstore_address
        self.stage_timeout_s = stage_timeout_s

    # NOTE: channels are made on first use, inside the server's event loop.
    def kvstore(self) -> KvstoreClient:
        return KvstoreClient(self.channels.get(self.kvstore_address))

    def prefill(self, address: str) -> PrefillClient:
        return PrefillClient(self.channels.get(address), timeout_s=self.stage_timeout_s)

    def relay(self, address: str) -> RelayClient:
        return RelayClient(self.channels.get(address), timeout_s=self.stage_timeout_s)

    def main_decode(self, address: str) -> MainDecodeClient:
        return MainDecodeClient(self.channels.get(address), timeout_s=self.stage_timeout_s)

    async def close(self) -> None:
        await self.channels.close()


@dataclass
class _Run:
    """One request in flight: what it was routed to, its stage calls and its merge so far."""

    job: GenerateJob
    sampling: SamplingParams
    plan: Route
    stats: RequestStats
    t0: float
    queue: asyncio.Queue[StageItem] = field(default_factory=asyncio.Queue)
    # Every call opened for the request (stage streams, the gateway's own handoff).
    calls: list[Cancellable] = field(default_factory=list)
    merge: TokenMerge = field(default_factory=TokenMerge)
    relay_done: bool = False
    finish: str | None = None
    completion_tokens: int | None = None

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None


def _stats(job: GenerateJob, plan: Route) -> RequestStats:
    return RequestStats(
        pipeline=plan.pipeline,
        handoff_mode=plan.handoff_mode,
        prompt_tokens=len(job.prompt_token_ids),
        predicted_hit_rate=plan.predicted_hit_rate,
        prefill_instance=plan.prefill.ref.instance_id if plan.pipeline is not Pipeline.MD else "",
        main_decode_instance=plan.main_decode.ref.instance_id,
        relay_instance=plan.relay.ref.instance_id if plan.relay else "",
    )


async def _accepted(stream: EventStream, stage: Stage) -> Accepted:
    event = await stream.read()
    if not isinstance(event, Accepted):
        raise UnavailableError(f"{stage.value} closed the stream before accepting the request")
    return event


class Gateway:
    def __init__(
        self,
        kvstore_address: str,
        routing: RoutingConfig = RoutingConfig(),
        rng: random.Random | None = None,
        stage_timeout_s: float = 600.0,
        *,
        tls: TlsConfig | None = None,
        peers: Peers | None = None,
    ) -> None:
        """``peers``: where the kvstore, prefill, relay and MainDecode clients come from; by
        default gRPC clients on channels with ``tls`` (then required)."""
        self.routing = routing
        self.rng = rng or random.Random()
        self.stage_timeout_s = stage_timeout_s
        if peers is None:
            if tls is None:
                raise ValueError("tls: required unless the gateway is given its peers")
            peers = GrpcPeers(Channels(tls), kvstore_address, stage_timeout_s)
        self.peers = peers

    async def close(self) -> None:
        await self.peers.close()

    async def instances(self) -> list[Instance]:
        return await self.peers.kvstore().list()

    async def choose_route(self, job: GenerateJob) -> Route:
        """The pipeline and instances for ``job``, from kvstore's predicted prefix hits."""
        hits = await self.peers.kvstore().predict(job.prompt_token_ids, job.cache_salt)
        cached = {h.instance.ref.instance_id: h.cached_tokens for h in hits}
        try:
            return route(
                len(job.prompt_token_ids),
                [h.instance for h in hits],
                cached,
                self.rng,
                self.routing,
                force_pipeline=job.force_pipeline,
                force_handoff=job.handoff_mode,
            )
        except NoInstanceError as exc:
            raise UnavailableError(str(exc)) from None

    async def generate(
        self, job: GenerateJob, ending: Ending | None = None
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """The request's events. A caller that ends it early on purpose (a stop string) says why in
        ``ending`` before closing the stream; otherwise a stream closed early counts as cancelled."""
        tracker = RequestTracker()
        final = False
        try:
            # NOTE: aclosing: a client that goes away must cancel the stage calls at once, not at GC.
            async with contextlib.aclosing(self._generate(job, tracker)) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        tracker.tokens(len(event.token_ids), event.stage.value)
                    else:
                        tracker.finished(event.finish_reason)
                        final = True
                    yield event
        except Exception:
            tracker.failed()
            raise
        finally:
            if not final and ending is not None and ending.reason is not None:
                tracker.finished(ending.reason)
            tracker.close()

    async def _generate(
        self, job: GenerateJob, tracker: RequestTracker
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        t0 = time.perf_counter()
        sampling = job.sampling
        if not sampling.greedy and sampling.seed is None:
            # NOTE: every engine must draw from the same seed, or a handoff changes the sample.
            sampling = replace(sampling, seed=self.rng.getrandbits(63))
        plan = await self.choose_route(job)
        run = _Run(job, sampling, plan, _stats(job, plan), t0)
        tracker.routed(plan.pipeline.value, len(job.prompt_token_ids))
        log.info(
            "routed",
            pipeline=plan.pipeline.value,
            predicted_hit=round(plan.predicted_hit_rate, 4),
            prefill=run.stats.prefill_instance,
            relay=run.stats.relay_instance,
            main_decode=run.stats.main_decode_instance,
        )
        readers: list[asyncio.Task] = []
        try:
            streams = await self._open(run)
            readers = [asyncio.create_task(self._pump(st, s, run.queue)) for st, s in streams]
            async for event in self._merged(run, live=len(readers)):
                yield event
        finally:
            for task in readers:
                task.cancel()
            for call in run.calls:
                call.cancel()

    async def _open(self, run: _Run) -> list[tuple[Stage, EventStream]]:
        """Open the request's stage streams (prefill, main_decode, relay: the order they are read
        in); MainDecode and the relay have accepted it before prefill is called."""
        job, plan = run.job, run.plan
        md = self.peers.main_decode(plan.main_decode.ref.address).decode(
            DecodeJob(
                job.request_id, job.prompt_token_ids, run.sampling, job.cache_salt, plan.pipeline
            )
        )
        run.calls.append(md)
        decoding = [(Stage.MAIN_DECODE, md)]
        if plan.pipeline is Pipeline.P_RLD_MD:
            assert plan.relay is not None and plan.handoff_mode is not None
            relay = self.peers.relay(plan.relay.ref.address).decode(
                RelayJob(
                    job.request_id,
                    job.prompt_token_ids,
                    run.sampling,
                    job.cache_salt,
                    plan.main_decode.ref,
                    plan.handoff_mode,
                )
            )
            run.calls.append(relay)
            decoding.append((Stage.RELAY, relay))
        # NOTE: MainDecode and the relay accept independently: one round trip, not two, before prefill.
        accepted, *_ = await asyncio.gather(*(_accepted(s, st) for st, s in decoding))
        run.stats.md_cached_tokens = accepted.cached_tokens
        if plan.pipeline is Pipeline.MD:
            return decoding
        prefill = self.peers.prefill(plan.prefill.ref.address).prefill(
            PrefillJob(
                job.request_id,
                job.prompt_token_ids,
                run.sampling,
                job.cache_salt,
                plan.pipeline,
                plan.main_decode.ref,
                run.stats.md_cached_tokens,
                plan.relay.ref if plan.relay else None,
            )
        )
        run.calls.append(prefill)
        return [(Stage.PREFILL, prefill), *decoding]

    async def _pump(
        self, stage: Stage, stream: EventStream, queue: asyncio.Queue[StageItem]
    ) -> None:
        # NOTE: read(), not `async for`: grpc.aio forbids mixing both on one call (_accepted read()).
        try:
            while (event := await stream.read()) is not None:
                queue.put_nowait(StageEvent(stage, event))
        except PeerError as exc:
            if not exc.cancelled:
                queue.put_nowait(StageFailed(stage, exc))
        except Exception as exc:  # noqa: BLE001 — never let a stage's stream fail silently
            queue.put_nowait(StageFailed(stage, exc))
        queue.put_nowait(StageEnded(stage))

    async def _merged(self, run: _Run, live: int) -> AsyncIterator[TokenEvent | FinalEvent]:
        # NOTE: every service ends its stream when its part is done (prefill after TransferDone,
        # relay after HandedOff/Finished, main_decode after Finished), so all ends = request done.
        while live:
            match await run.queue.get():
                case StageEnded():
                    live -= 1
                case StageFailed(stage=Stage.RELAY, error=error) if not run.relay_done:
                    # NOTE: the relay is gone mid-request: drive the handoff from the tokens streamed.
                    await self._take_over(run, error)
                case StageFailed(error=error):
                    raise error
                case StageEvent(stage=stage, event=event):
                    for ev in self._apply(run, stage, event):
                        _count(run, ev)
                        yield ev
        yield _final(run)

    def _apply(self, run: _Run, stage: Stage, event: object) -> list[TokenEvent]:
        """Fold one stage event into the request's stats and merge; the tokens now in order."""
        stats = run.stats
        match event:
            case FirstToken():
                stats.prefill_cached_tokens = event.cached_tokens
                if run.logprobs and event.logprob is None:
                    raise FailedPreconditionError(
                        f"{stage.value} sent its token without the logprobs asked for"
                    )
                lps = [event.logprob] if run.logprobs else []
                return run.merge.add(0, [event.token_id], Stage.PREFILL, lps)
            case TransferDone():
                stats.wan_kv_bytes = event.wan_kv_bytes
                stats.wan_transfer_ms = event.wan_transfer_ms
            case Tokens():
                if run.logprobs and len(event.logprobs) != len(event.token_ids):
                    raise FailedPreconditionError(
                        f"{stage.value} sent {len(event.logprobs)} logprobs for "
                        f"{len(event.token_ids)} tokens; the request asked for them"
                    )
                lps = event.logprobs if run.logprobs else ()
                return run.merge.add(event.start_position, event.token_ids, stage, lps)
            case HandedOff():
                stats.handoff_at_token = event.at_position
                run.relay_done = True
            case Finished():
                run.relay_done = run.relay_done or stage is Stage.RELAY
                run.finish = event.finish_reason or run.finish
                run.completion_tokens = max(run.completion_tokens or 0, event.completion_tokens)
        return []

    async def _take_over(self, run: _Run, cause: BaseException) -> None:
        """Hand the request to MainDecode ourselves: token IDs are all it needs besides its KV."""
        plan, tokens = run.plan, tuple(run.merge.emitted)
        log.warning("relay_lost_gateway_handoff", at=len(tokens), error=str(cause)[:200])
        HANDOFFS.labels(
            plan.handoff_mode.value if plan.handoff_mode else "one-shot", "gateway"
        ).inc()
        call = self.peers.main_decode(plan.main_decode.ref.address).token_handoff()
        run.calls.append(call)
        batch = HandoffBatch(run.job.request_id, 0, tokens, final=True, mode=plan.handoff_mode)
        await call.send(batch)
        await call.done(wait=True)
        run.stats.handoff_at_token = len(tokens)
        run.relay_done = True


def _count(run: _Run, ev: TokenEvent) -> None:
    stats = run.stats
    if ev.start_position == 0:
        stats.ttft_ms = (time.perf_counter() - run.t0) * 1000
    stats.completion_tokens += len(ev.token_ids)
    if ev.stage is Stage.RELAY:
        stats.rld_tokens += len(ev.token_ids)
    elif ev.stage is Stage.MAIN_DECODE:
        stats.md_tokens += len(ev.token_ids)


def _final(run: _Run) -> FinalEvent:
    """The final event, once every stage ended: only if the merged stream has no gap."""
    merge, completion_tokens = run.merge, run.completion_tokens
    if merge.pending or (completion_tokens is not None and merge.next_pos < completion_tokens):
        raise FailedPreconditionError(
            f"token stream has a gap: delivered {merge.next_pos} of {completion_tokens} tokens"
        )
    run.stats.e2e_ms = (time.perf_counter() - run.t0) * 1000
    return FinalEvent(run.finish, run.stats)
