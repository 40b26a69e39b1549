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
stands. A MainDecode that fails before it accepts the request is a loss like any other (the
request starts MD on another); a relay that does falls back to P-MD on the same MainDecode. A
MainDecode lost once the client has every token (max_tokens, a stop token, or the relay finished
it) ends the request here with the finish reason the engine would have given (``_ended``).

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
from dataclasses import replace

import structlog

from pdd.core.errors import PddError, PeerError, UnavailableError
from pdd.core.instance import Instance, Role
from pdd.core.pipeline import Pipeline, Stage
from pdd.core.request import Ending, FinalEvent, GenerateJob, TokenEvent
from pdd.core.stage_events import Accepted, DecodeJob, HandoffBatch, PrefillJob, RelayJob
from pdd.routing.policy import NoInstanceError, Route, RoutingConfig, route
from pdd.server.tls import TlsConfig
from pdd.serving.channels import Channels
from pdd.serving.gateway_peers import GrpcPeers, Peers
from pdd.serving.gateway_run import (
    MAIN_DECODE_LOST,
    PREFILL_LOST,
    Loss,
    Refused,
    Run,
    StageEnded,
    StageEvent,
    StageFailed,
    StageItem,
    apply_event,
    count_tokens,
    final_event,
    finish_here,
    refusal_of,
    stats_for,
    stop_calls,
    wait_accepted,
)
from pdd.serving.instance_view import InstanceView
from pdd.telemetry.metrics import HANDOFFS, MIGRATIONS, RequestTracker
from pdd.wire.call import EventStream

log = structlog.get_logger(__name__)


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
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        """``peers``: where the kvstore, prefill, relay and MainDecode clients come from; by
        default gRPC clients on channels with ``tls`` (then required). ``index_timeout_s``: the
        deadline of each kvstore call, past which the request is routed without the index.
        ``eos_token_ids``: the model's (None: unknown), so that a request whose MainDecode dies
        after the client has its last token can be finished here (``_ended``)."""
        self.routing = routing
        self.rng = rng or random.Random()
        self.stage_timeout_s = stage_timeout_s
        if max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {max_migrations}")
        # How many times one request may move to another MainDecode (a poisoned request must
        # not walk the whole fleet).
        self.max_migrations = max_migrations
        self.eos_token_ids = eos_token_ids
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
        run = Run(job, sampling, plan, stats_for(job, plan), t0)
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
            await self._start(run)
            async for event in self._merged(run):
                yield event
        finally:
            stop_calls(run)

    async def _start(self, run: Run) -> None:
        """Open the request's stage streams and read them (prefill, main_decode, relay: the order
        they are read in). MainDecode failing before it accepts moves the request like a later
        loss (another MainDecode, counted against ``max_migrations``)."""
        try:
            accepted, streams = await self._accept(run)
        except Refused as refused:
            run.lost.add(run.plan.main_decode.ref.instance_id)
            await self._migrate(run, Loss(MAIN_DECODE_LOST, refused.error))
            return
        run.stats.md_cached_tokens = accepted.cached_tokens
        if run.plan.pipeline is not Pipeline.MD:
            streams = [(Stage.PREFILL, self._open_prefill(run)), *streams]
        self._read(run, streams)

    async def _accept(self, run: Run) -> tuple[Accepted, list[tuple[Stage, EventStream]]]:
        """Open MainDecode's (and the relay's) stream; both accept before prefill is called. A
        relay failing first: P-MD on the same MainDecode. ``Refused``: MainDecode failed first."""
        plan = run.plan
        streams = [(Stage.MAIN_DECODE, self._open_decode(run, plan.main_decode, plan.pipeline))]
        if plan.pipeline is Pipeline.P_RLD_MD:
            streams.append((Stage.RELAY, self._open_relay(run)))
        # NOTE: MainDecode and the relay accept independently: one round trip, not two, before prefill.
        md, *relay = await asyncio.gather(
            *(wait_accepted(s, st) for st, s in streams), return_exceptions=True
        )
        if (refusal := refusal_of(md)) is not None:
            raise Refused(refusal)
        if relay and (refusal := refusal_of(relay[0])) is not None:
            return await self._without_relay(run, refusal)
        assert isinstance(md, Accepted)
        return md, streams

    async def _without_relay(
        self, run: Run, error: Exception
    ) -> tuple[Accepted, list[tuple[Stage, EventStream]]]:
        """The relay failed before accepting: the request goes P-MD on the same MainDecode, its
        call reopened as P-MD (so MainDecode starts from prefill's first token, not a handoff)."""
        log.warning("relay_refused_p_md", relay=run.stats.relay_instance, error=str(error)[:200])
        stop_calls(run)
        run.plan = replace(run.plan, pipeline=Pipeline.P_MD, relay=None, handoff_mode=None)
        stats = run.stats
        stats.pipeline, stats.handoff_mode, stats.relay_instance = Pipeline.P_MD, None, ""
        stream = self._open_decode(run, run.plan.main_decode, Pipeline.P_MD)
        try:
            return await wait_accepted(stream, Stage.MAIN_DECODE), [(Stage.MAIN_DECODE, stream)]
        except (PeerError, UnavailableError) as exc:
            raise Refused(exc) from None

    def _open_decode(
        self, run: Run, target: Instance, pipeline: Pipeline, resume: tuple[int, ...] = ()
    ) -> EventStream:
        job = run.job
        stream = self.peers.main_decode(target.ref.address).decode(
            DecodeJob(
                job.request_id,
                job.prompt_token_ids,
                run.sampling,
                job.cache_salt,
                pipeline,
                resume_token_ids=resume,
            )
        )
        run.calls.append(stream)
        return stream

    def _open_relay(self, run: Run) -> EventStream:
        job, plan = run.job, run.plan
        assert plan.relay is not None and plan.handoff_mode is not None
        stream = self.peers.relay(plan.relay.ref.address).decode(
            RelayJob(
                job.request_id,
                job.prompt_token_ids,
                run.sampling,
                job.cache_salt,
                plan.main_decode.ref,
                plan.handoff_mode,
            )
        )
        run.calls.append(stream)
        return stream

    def _open_prefill(self, run: Run) -> EventStream:
        job, plan = run.job, run.plan
        stream = self.peers.prefill(plan.prefill.ref.address).prefill(
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
        run.calls.append(stream)
        return stream

    def _read(self, run: Run, streams: list[tuple[Stage, EventStream]]) -> None:
        """Read ``streams`` into a fresh queue (what older readers left on theirs is dropped)."""
        run.queue = asyncio.Queue()
        run.readers = [asyncio.create_task(self._pump(st, s, run.queue)) for st, s in streams]
        run.streaming = {st for st, _ in streams}

    async def _pump(
        self, stage: Stage, stream: EventStream, queue: asyncio.Queue[StageItem]
    ) -> None:
        # NOTE: read(), not `async for`: grpc.aio forbids mixing both on one call (accepted read()).
        try:
            while (event := await stream.read()) is not None:
                queue.put_nowait(StageEvent(stage, event))
        except PeerError as exc:
            if not exc.cancelled:
                queue.put_nowait(StageFailed(stage, exc))
        except Exception as exc:  # noqa: BLE001 — never let a stage's stream fail silently
            queue.put_nowait(StageFailed(stage, exc))
        queue.put_nowait(StageEnded(stage))

    async def _merged(self, run: Run) -> AsyncIterator[TokenEvent | FinalEvent]:
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
                    for ev in apply_event(run, stage, event):
                        count_tokens(run, ev)
                        yield ev
        if run.pending is not None and run.finish is None:
            raise run.pending.error
        yield final_event(run)

    async def _on_failed(self, run: Run, stage: Stage, error: Exception) -> None:
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
                await self._migrate(run, Loss(MAIN_DECODE_LOST, exc))
            return
        if stage is Stage.RELAY or not isinstance(error, PeerError):
            raise error
        if run.finish is not None and stage is not Stage.MAIN_DECODE:
            raise error
        if stage is Stage.MAIN_DECODE:
            run.lost.add(run.plan.main_decode.ref.instance_id)
        loss = Loss(MAIN_DECODE_LOST if stage is Stage.MAIN_DECODE else PREFILL_LOST, error)
        if Stage.RELAY in run.streaming and not run.relay_done:
            # NOTE: the relay still streams: it fails (or ends) once its handoff does; then move.
            run.pending = run.pending or loss
            return
        await self._migrate(run, loss)

    async def _migrate(self, run: Run, loss: Loss) -> None:
        """Move the request to another live MainDecode from the tokens streamed so far (every
        other stage call cancelled; MainDecode prefills what it lacks itself), or finish it here
        if the client has every token already; the original error if the limit is reached, no
        MainDecode is left or nothing is left to decode."""
        stop_calls(run)
        if (reason := self._ended(run)) is not None:
            finish_here(run, reason, loss)
            return
        run.merge.pending.clear()  # NOTE: held tokens of the old path: the new one recomputes them
        at = len(run.merge.emitted)
        while run.stats.migrations < self.max_migrations and at < run.sampling.max_tokens:
            target = await self._next_main_decode(run)
            if target is None:
                break
            run.stats.migrations += 1
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
                loss = Loss(MAIN_DECODE_LOST, loss.error)
        raise loss.error

    def _ended(self, run: Run) -> str | None:
        """Why the request ended, if the client has every token and the gateway can tell as the
        engine would (a stop token ends it, even the last one; else max_tokens: "length"). None
        if it may go on or only MainDecode can say (a grammar completed, an eos id unknown
        here): then it migrates with what was streamed and the new MainDecode says."""
        if run.finish is not None:  # NOTE: a stage said so already (the relay finished it)
            return run.finish
        out, sp = run.merge.emitted, run.sampling
        if not out:
            return None
        eos = () if sp.ignore_eos else self.eos_token_ids
        if out[-1] in sp.stop_token_ids or (eos is not None and out[-1] in eos):
            return "stop"
        if len(out) >= sp.max_tokens and eos is not None:
            return "length"
        return None

    async def _next_main_decode(self, run: Run) -> Instance | None:
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

    async def _resume(self, run: Run, target: Instance) -> None:
        """Open the request on ``target`` as MD from the tokens streamed; read it once accepted."""
        stream = self._open_decode(run, target, Pipeline.MD, tuple(run.merge.emitted))
        await wait_accepted(stream, Stage.MAIN_DECODE)
        # NOTE: no relay and no prefill any more: nothing to take over, nothing pending.
        run.relay_done, run.pending = True, None
        run.stats.main_decode_instance = target.ref.instance_id
        self._read(run, [(Stage.MAIN_DECODE, stream)])

    async def _take_over(self, run: Run, cause: BaseException) -> None:
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
