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

Migration: when MainDecode's stream fails (or prefill's, before the request is done) and no
relay is streaming, the gateway cancels the request's other stage calls and opens an MD
``decode`` on another live MainDecode (for a prefill loss possibly the same one) with the tokens
streamed so far as ``resume_token_ids``: MainDecode prefills prompt + those itself and speaks
from the next position, so the merge goes on with nothing lost or repeated (draws depend only on
seed and position; penalties and grammar follow the tokens). A relay still streaming when
MainDecode dies is *not* kept decoding to the end: its own stream fails once its handoff (or its
wait for MainDecode's KV) does, and the request then migrates from what was streamed. At most
``max_migrations`` per request; beyond it, or with no other MainDecode, the original error
stands.

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

from pdd.core.errors import FailedPreconditionError, PddError, PeerError, UnavailableError
from pdd.core.instance import Instance, Role
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
from pdd.serving.instance_view import InstanceView
from pdd.serving.token_merge import TokenMerge
from pdd.telemetry.metrics import HANDOFFS, MIGRATIONS, RequestTracker
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

MAIN_DECODE_LOST = "main_decode_lost"
PREFILL_LOST = "prefill_lost"


@dataclass(frozen=True)
class _Loss:
    """A stage lost mid-request: why the request moves to another MainDecode, and the error it
    fails with if it cannot."""

    cause: str
    error: Exception

    def __post_init__(self) -> None:
        if self.cause not in (MAIN_DECODE_LOST, PREFILL_LOST):
            raise ValueError(f"cause: {MAIN_DECODE_LOST} or {PREFILL_LOST}, got {self.cause!r}")


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

    def __init__(
        self,
        channels: Channels,
        kvstore_address: str,
        stage_timeout_s: float,
        index_timeout_s: float = 1.0,
    ) -> None:
        self.channels = channels
        self.kvstore_address = kvstore_address
        self.stage_timeout_s = stage_timeout_s
        self.index_timeout_s = index_timeout_s

    # NOTE: channels are made on first use, inside the server's event loop.
    def kvstore(self) -> KvstoreClient:
        return KvstoreClient(
            self.channels.get(self.kvstore_address), timeout_s=self.index_timeout_s
        )

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
    # The tasks reading the stage streams into ``queue``, and the stages whose streams are open.
    readers: list[asyncio.Task] = field(default_factory=list)
    streaming: set[Stage] = field(default_factory=set)
    # MainDecode instances lost for this request (never chosen again for it); a loss waiting
    # for the relay's stream to end before the request migrates; migrations so far.
    lost: set[str] = field(default_factory=set)
    pending: _Loss | None = None
    migrations: int = 0

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
        index_timeout_s: float = 1.0,
        max_migrations: int = 2,
    ) -> None:
        """``peers``: where the kvstore, prefill, relay and MainDecode clients come from; by
        default gRPC clients on channels with ``tls`` (then required). ``index_timeout_s``: the
        deadline of each kvstore call, past which the request is routed without the index."""
        self.routing = routing
        self.rng = rng or random.Random()
        self.stage_timeout_s = stage_timeout_s
        if max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {max_migrations}")
        # How many times one request may move to another MainDecode (a poisoned request must
        # not walk the whole fleet).
        self.max_migrations = max_migrations
        if peers is None:
            if tls is None:
                raise ValueError("tls: required unless the gateway is given its peers")
            peers = GrpcPeers(Channels(tls), kvstore_address, stage_timeout_s, index_timeout_s)
        self.peers = peers
        # The last known instances: routing goes on from them while the index is down.
        self.view = InstanceView(peers.kvstore)

    async def close(self) -> None:
        await self.view.close()
        await self.peers.close()

    async def instances(self) -> list[Instance]:
        """kvstore's live instances; the last known ones while it is unreachable."""
        return await self.view.list()

    async def choose_route(self, job: GenerateJob) -> Route:
        """The pipeline and instances for ``job``, from kvstore's predicted prefix hits; while
        the index is unreachable, from the last known instances, every hit 0 (``InstanceView``)."""
        hits = await self.view.predict(job.prompt_token_ids, job.cache_salt)
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
        try:
            self._read(run, await self._open(run))
            async for event in self._merged(run):
                yield event
        finally:
            _stop(run)

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

    def _read(self, run: _Run, streams: list[tuple[Stage, EventStream]]) -> None:
        """Read ``streams`` into a fresh queue (what older readers left on theirs is dropped)."""
        run.queue = asyncio.Queue()
        run.readers = [asyncio.create_task(self._pump(st, s, run.queue)) for st, s in streams]
        run.streaming = {st for st, _ in streams}

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

    async def _merged(self, run: _Run) -> AsyncIterator[TokenEvent | FinalEvent]:
        # NOTE: every service ends its stream when its part is done (prefill after TransferDone,
        # relay after HandedOff/Finished, main_decode after Finished), so all ends = request done.
        # A migration replaces run.queue and run.streaming: read both afresh each time.
        while run.streaming:
            match await run.queue.get():
                case StageEnded(stage=stage):
                    run.streaming.discard(stage)
                    if stage is Stage.RELAY and run.pending and run.finish is None:
                        await self._migrate(run, run.pending)
                case StageFailed(stage=stage, error=error):
                    await self._on_failed(run, stage, error)
                case StageEvent(stage=stage, event=event):
                    for ev in self._apply(run, stage, event):
                        _count(run, ev)
                        yield ev
        if run.pending is not None and run.finish is None:
            raise run.pending.error
        yield _final(run)

    async def _on_failed(self, run: _Run, stage: Stage, error: Exception) -> None:
        """A stage's stream broke: hand over for a lost relay, move the request to another
        MainDecode for a lost MainDecode or prefill, or fail the request."""
        if stage is Stage.RELAY and not run.relay_done:
            if run.pending is not None:  # MainDecode (or prefill) went first: now move
                await self._migrate(run, run.pending)
                return
            try:
                # NOTE: the relay is gone mid-request: drive the handoff from the tokens streamed.
                await self._take_over(run, error)
            except (PeerError, UnavailableError) as exc:  # ... and MainDecode is gone too
                run.lost.add(run.plan.main_decode.ref.instance_id)
                await self._migrate(run, _Loss(MAIN_DECODE_LOST, exc))
            return
        if stage is Stage.RELAY or run.finish is not None or not isinstance(error, PeerError):
            raise error
        if stage is Stage.MAIN_DECODE:
            run.lost.add(run.plan.main_decode.ref.instance_id)
        loss = _Loss(MAIN_DECODE_LOST if stage is Stage.MAIN_DECODE else PREFILL_LOST, error)
        if Stage.RELAY in run.streaming and not run.relay_done:
            # NOTE: the relay still streams: it fails (or ends) once its handoff does; then move.
            run.pending = run.pending or loss
            return
        await self._migrate(run, loss)

    async def _migrate(self, run: _Run, loss: _Loss) -> None:
        """Move the request to another live MainDecode from the tokens streamed so far (every
        other stage call cancelled; MainDecode prefills what it lacks itself); the original
        error if the limit is reached, no MainDecode is left or nothing is left to decode."""
        _stop(run)
        run.merge.pending.clear()  # NOTE: held tokens of the old path: the new one recomputes them
        at = len(run.merge.emitted)
        while run.migrations < self.max_migrations and at < run.sampling.max_tokens:
            target = await self._next_main_decode(run)
            if target is None:
                break
            run.migrations += 1
            MIGRATIONS.labels(loss.cause).inc()
            source, run.plan = run.plan.main_decode, replace(run.plan, main_decode=target)
            log.warning(
                "migrated",
                from_instance=source.ref.instance_id,
                to_instance=target.ref.instance_id,
                at=at,
                cause=loss.cause,
                error=str(loss.error)[:200],
            )
            try:
                await self._resume(run, target)
                return
            except (PeerError, UnavailableError) as exc:
                log.warning("migration_refused", instance=target.ref.instance_id, error=str(exc))
                run.lost.add(target.ref.instance_id)
                loss = _Loss(MAIN_DECODE_LOST, loss.error)
        raise loss.error

    async def _next_main_decode(self, run: _Run) -> Instance | None:
        """A live MainDecode not lost for this request (the seeded rng picks among them)."""
        try:
            instances = await self.instances()
        except PddError as exc:
            log.warning("migration_without_instances", error=str(exc)[:200])
            return None
        candidates = sorted(
            (
                i
                for i in instances
                if i.ref.role is Role.MAIN_DECODE and i.ref.instance_id not in run.lost
            ),
            key=lambda i: i.ref.instance_id,
        )
        return self.rng.choice(candidates) if candidates else None

    async def _resume(self, run: _Run, target: Instance) -> None:
        """Open the request on ``target`` as MD from the tokens streamed; read it once accepted."""
        job = run.job
        resume = tuple(run.merge.emitted)
        stream = self.peers.main_decode(target.ref.address).decode(
            DecodeJob(
                job.request_id,
                job.prompt_token_ids,
                run.sampling,
                job.cache_salt,
                Pipeline.MD,
                resume_token_ids=resume,
            )
        )
        run.calls.append(stream)
        await _accepted(stream, Stage.MAIN_DECODE)
        # NOTE: no relay and no prefill any more: nothing to take over, nothing pending.
        run.relay_done, run.pending = True, None
        run.stats.main_decode_instance = target.ref.instance_id
        self._read(run, [(Stage.MAIN_DECODE, stream)])

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


def _stop(run: _Run) -> None:
    """Cancel the request's readers and stage calls (each service frees the request's KV)."""
    for task in run.readers:
        task.cancel()
    for call in run.calls:
        call.cancel()
    run.readers, run.calls = [], []


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
