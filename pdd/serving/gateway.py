"""The gateway's request life: predict, route, fan out, merge one stream.

Life of a request:
  1. kvstore: live instances + predicted prefix hits of the prompt;
  2. router (pure policy): pipeline MD, P-MD or P-RLD-MD, the instances, the
     handoff mode;
  3. main_decode.Decode is opened: MainDecode matches the prompt in its
     DRC and *locks* the hit, answering how many tokens it holds — so the
     push can start exactly there and nothing is evicted meanwhile;
  4. P-RLD-MD: relay.Decode is opened at the same time (the relay waits for
     its KV) and accepts before prefill is called (it is beside prefill);
  5. prefill.Prefill (not for MD, where MainDecode prefills the short
     uncached suffix itself) is opened without waiting for MainDecode's answer,
     a WAN round trip: the prompt is computed meanwhile, and MainDecode's hit
     is bound to it when MainDecode accepts (``BindMainDecode``). The first
     token comes back as soon as it is sampled (output position 0) and waits
     here until MainDecode has accepted; KV flows to the relay (fast link) and
     the delta to MainDecode (WAN);
  6. relay and main_decode token deltas are merged by output position —
     duplicates dropped, gaps buffered — into one unbroken stream; the relay
     says where it handed over, MainDecode continues from there (if the relay
     dies first, the gateway hands MainDecode the tokens streamed so far itself);
  7. the final message carries finish reason and measured stats.
A client that goes away cancels every call, and each service frees the
request's KV when its call is cancelled.

A stage lost mid-request (MainDecode, prefill, the relay) is survived by the fault paths in
``pdd.serving.gateway_recovery`` (migration, re-home beside a relay that decodes on, the
gateway's own handoff), which ``Gateway`` inherits. A MainDecode that fails before it accepts
the request is a loss like any other, one that refuses it (full) sends it to another before any
token was streamed; a relay that fails to accept falls back to P-MD on the same MainDecode
(``_without_relay``).

Each stage's stream is read by its own task into the request's queue (``StageEvent``,
``StageFailed``, ``StageEnded``); the merge reads the queue, so the peers are typed clients
(``pdd.wire``) or, in tests, in-process fakes with the same methods (``peers=``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import structlog

from pdd.core.errors import PeerError, ResourceExhaustedError, UnavailableError
from pdd.core.instance import Instance
from pdd.core.pipeline import Pipeline, Stage
from pdd.core.request import Ending, FinalEvent, GenerateJob, TokenEvent
from pdd.core.stage_events import (
    FAST_LINK_FAILED,
    Accepted,
    DecodeJob,
    FirstToken,
    PrefillJob,
    RelayJob,
    TransferDone,
)
from pdd.routing.policy import (
    LinkView,
    NoInstanceError,
    Route,
    RouteReason,
    RoutingConfig,
    route,
)
from pdd.server.tls import TlsConfig
from pdd.serving.admission import DEFAULT_MAX_IN_FLIGHT, Admission, Limits
from pdd.serving.channels import Channels
from pdd.serving.concurrency_limit import GradientConfig, GradientLimit
from pdd.serving.gateway_peers import REQUEST_DEADLINE, GrpcPeers, Peers
from pdd.serving.gateway_recovery import Recovery, is_refusal
from pdd.serving.gateway_run import (
    AskAgain,
    KvDeadline,
    Rehomed,
    Run,
    StageEnded,
    StageEvent,
    StageFailed,
    add_reader,
    apply_event,
    delivered,
    final_event,
    stats_for,
    stop_calls,
    wait_accepted,
)
from pdd.serving.instance_view import InstanceView
from pdd.serving.route_ledger import RouteLedger
from pdd.telemetry.metrics import IN_FLIGHT_LIMIT, RELAY_FULL, RequestTracker
from pdd.wire.call import EventStream

log = structlog.get_logger(__name__)

# Waits before each retry of a bind that reached prefill before its Prefill call did.
BIND_RETRY_DELAYS_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
# How long a token may wait for the ones its stream reads right after it (``_merged``): only
# while every turn of the event loop brings another, as on a saturated gateway.
JOIN_HOLD_S = 0.002


class Gateway(Recovery):
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
        kv_deadline_s: float = 0.0,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        adaptive_in_flight: bool = False,
        admission_wait_s: float = 0.0,
        kv_bytes_per_token: int = 0,
        shared_decode_stream: bool = True,
    ) -> None:
        """``peers``: where the kvstore, prefill, relay and MainDecode clients come from; by
        default gRPC clients on channels with ``tls`` (then required). ``index_timeout_s``: the
        deadline of each kvstore call, past which the request is routed without the index.
        ``eos_token_ids``: the model's (None: unknown), so that a request whose MainDecode dies
        after the client has its last token can be finished here (``_ended``).
        ``max_in_flight``: requests generated at once; beyond, RESOURCE_EXHAUSTED at once.
        ``adaptive_in_flight``: the bound follows the latency the stack adds when it queues
        (``concurrency_limit``), ``max_in_flight`` its ceiling. ``admission_wait_s``: how long a
        request finding the bound reached waits for a place before it is refused (0: never).
        ``kv_bytes_per_token``: KV bytes one prompt token takes on the WAN (the model's shape ×
        the wire dtype), for the link-aware router's transfer estimate; 0: unknown (θ rule).
        ``shared_decode_stream``: each MainDecode's requests on one ``DecodeMany`` stream."""
        self.routing = routing
        self.rng = rng or random.Random()
        self.stage_timeout_s = stage_timeout_s
        if max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {max_migrations}")
        # How many times one request may move to another MainDecode (a poisoned request must
        # not walk the whole fleet).
        self.max_migrations = max_migrations
        if kv_deadline_s < 0:
            raise ValueError(f"kv_deadline_s: must be >= 0, got {kv_deadline_s}")
        # How long a P-MD request's first token may wait for MainDecode's KV before the request
        # is re-routed through the relay (a partitioned or stalled WAN); 0: never.
        self.kv_deadline_s = kv_deadline_s
        self.eos_token_ids = eos_token_ids
        if kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token: must be >= 0, got {kv_bytes_per_token}")
        self.kv_bytes_per_token = kv_bytes_per_token
        # What this gateway routed and has not seen leave (relays, WAN links) and its recent
        # first-token latency: the router's picture between two heartbeats.
        self.ledger = RouteLedger()
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
        # NOTE: the gateway reserves no KV: only the request count is bounded — by the adaptive
        # limit under the max_in_flight ceiling, or by max_in_flight alone.
        self.limiter = (
            GradientLimit(
                GradientConfig(
                    initial=min(32, max_in_flight),
                    min_limit=min(4, max_in_flight),
                    max_limit=max_in_flight,
                )
            )
            if adaptive_in_flight
            else None
        )
        if admission_wait_s < 0:
            raise ValueError(f"admission_wait_s: must be >= 0, got {admission_wait_s}")
        self.admission_wait_s = admission_wait_s
        limiter = self.limiter
        IN_FLIGHT_LIMIT.set_function(lambda: limiter.limit if limiter else max_in_flight)
        self.admission = Admission(
            "gateway",
            lambda: Limits(limiter.limit if limiter else max_in_flight, sys.maxsize),
            fixed=limiter is None,
        )
        if peers is None:
            if tls is None:
                raise ValueError("tls: required unless the gateway is given its peers")
            peers = GrpcPeers(
                Channels(tls),
                kvstore_address,
                stage_timeout_s,
                index_timeout_s,
                shared_decode_stream=shared_decode_stream,
            )
        self.peers = peers
        # The last known instances: routing goes on from them while the index is down.
        self.view = InstanceView(peers.kvstore)
        # Requests between admission and their stage calls (routing: kvstore's answer). Each call
        # opened tells its stage how many others are still on their way (``burst_following``),
        # so an idle engine waits for a burst whose routing stalls (kvstore answers a burst of 16
        # over 2-50 ms) instead of prefilling its first few alone and the rest one step later.
        self.routing_now = 0

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
        ledger = self.ledger
        try:
            return route(
                len(job.prompt_token_ids),
                ledger.with_relay_holds([h.instance for h in hits]),
                cached,
                self.rng,
                self.routing,
                force_pipeline=job.force_pipeline,
                force_handoff=job.handoff_mode,
                kv_bytes_per_token=self.kv_bytes_per_token,
                link_view=LinkView(ledger.pending_bytes(), int(time.time() * 1000)),
                reference_ttft_s=ledger.reference_ttft_s(),
            )
        except NoInstanceError as exc:
            raise UnavailableError(str(exc)) from None

    async def generate(
        self, job: GenerateJob, ending: Ending | None = None, *, deadline_s: float | None = None
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """The request's events. A caller that ends it early on purpose (a stop string) says why in
        ``ending`` before closing the stream; otherwise a stream closed early counts as cancelled.
        ``deadline_s``: the client's time left (its gRPC deadline), which bounds every stage call
        (with ``stage_timeout_s``)."""
        wait_s = self.admission_wait_s
        if deadline_s is not None:
            wait_s = min(wait_s, deadline_s / 2)  # NOTE: leave the request time to run
        try:
            # NOTE: before any work
            ticket = await self.admission.admit_within(job.request_id, 0, wait_s)
        except ResourceExhaustedError:
            if self.limiter is not None:
                self.limiter.refused()
            raise
        admitted_at = time.perf_counter()
        # NOTE: the adaptive bound judges a limit only by the requests admitted under it
        admitted_round = self.limiter.round if self.limiter is not None else 0
        if deadline_s is not None:
            REQUEST_DEADLINE.set(time.monotonic() + deadline_s)
        tracker = RequestTracker()
        final = False
        try:
            # NOTE: aclosing: a client that goes away must cancel the stage calls at once, not at GC.
            async with contextlib.aclosing(self._generate(job, tracker)) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        if event.start_position == 0 and self.limiter is not None:
                            self.limiter.sample(
                                time.perf_counter() - admitted_at,
                                self.admission.admitted,
                                admitted_round,
                            )
                        tracker.tokens(len(event.token_ids), event.stage.value)
                    else:
                        tracker.finished(event.finish_reason)
                        final = True
                    yield event
        except Exception as exc:
            if self.limiter is not None and (
                isinstance(exc, ResourceExhaustedError) or is_refusal(exc)
            ):
                self.limiter.refused()  # NOTE: every stage of a role refused: overloaded too
            tracker.failed()
            raise
        finally:
            if not final and ending is not None and ending.reason is not None:
                tracker.finished(ending.reason)
            tracker.close()
            ticket.release()

    async def _generate(
        self, job: GenerateJob, tracker: RequestTracker
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        t0 = time.perf_counter()
        sampling = job.sampling
        if not sampling.greedy and sampling.seed is None:
            # NOTE: every engine must draw from the same seed, or a handoff changes the sample.
            sampling = replace(sampling, seed=self.rng.getrandbits(63))
        # NOTE: counted until the stage calls are open (``_following``); exactly once on every way.
        self.routing_now += 1
        try:
            plan = await self.choose_route(job)
            self.ledger.hold(
                job.request_id, plan, len(job.prompt_token_ids), self.kv_bytes_per_token
            )
        except BaseException:
            self.routing_now -= 1
            raise
        run = Run(job, sampling, plan, stats_for(job, plan), t0)  # NOTE: raises nothing
        try:
            try:
                self._routed(run, tracker)
                await self._start(run)
            finally:
                self.routing_now -= 1
            async for event in self._merged(run):
                yield event
        finally:
            self.ledger.release(job.request_id)
            if run.stats.ttft_ms:
                self.ledger.observe_ttft(run.stats.ttft_ms / 1000)
            stop_calls(run)

    async def _start(self, run: Run) -> None:
        """Open the request's stage calls and read them (prefill, main_decode, relay: the order
        they are read in). Nothing waits for MainDecode's answer, a WAN round trip: prefill is
        opened beside it without MainDecode's hit and bound to it once MainDecode accepts
        (``_bind``); until then no token reaches the client, so a MainDecode that refuses the
        request (full) sends it to another one on the same pipeline — or refuses the client —
        before a token was streamed, and one lost first moves it like a later loss
        (``_on_failed``). The relay, beside prefill, accepts first in P-RLD-MD: one failing to
        makes the request P-MD on the same MainDecode."""
        plan = run.plan
        streams = [(Stage.MAIN_DECODE, self._open_decode(run, plan.main_decode, plan.pipeline))]
        if plan.pipeline is Pipeline.P_RLD_MD:
            relay = self._open_relay(run)
            try:
                await wait_accepted(relay, Stage.RELAY)
                streams.append((Stage.RELAY, relay))
            except (PeerError, UnavailableError) as exc:
                streams = self._without_relay(run, exc)
        run.md_unanswered = True
        if run.plan.pipeline is not Pipeline.MD:
            streams = [(Stage.PREFILL, self._open_prefill(run)), *streams]
        self._read(run, streams)

    def _without_relay(self, run: Run, error: Exception) -> list[tuple[Stage, EventStream]]:
        """The relay failed before accepting: the request goes P-MD on the same MainDecode, its
        call reopened as P-MD (so MainDecode starts from prefill's first token, not a handoff)."""
        log.warning("relay_refused_p_md", relay=run.stats.relay_instance, error=str(error)[:200])
        self.ledger.release_relay(run.job.request_id)
        stop_calls(run)
        run.plan = replace(run.plan, pipeline=Pipeline.P_MD, relay=None, handoff_mode=None)
        stats = run.stats
        stats.pipeline, stats.handoff_mode, stats.relay_instance = Pipeline.P_MD, None, ""
        return [(Stage.MAIN_DECODE, self._open_decode(run, run.plan.main_decode, Pipeline.P_MD))]

    def _bind(self, run: Run, accepted: Accepted) -> None:
        """MainDecode accepted: its hit is the request's, and prefill's WAN push starts there
        (told beside the stream; a prefill lost meanwhile fails its own stream)."""
        run.md_unanswered = False
        run.stats.md_cached_tokens = accepted.cached_tokens
        if (stream := run.streaming.get(Stage.PREFILL)) is None:
            return
        client = self.peers.prefill(run.plan.prefill.ref.address)
        rid, cached = run.job.request_id, accepted.cached_tokens

        async def bind() -> None:
            # NOTE: the bind may overtake its Prefill call into the server (two streams):
            # NOT_FOUND is retried while that call is open.
            for delay_s in BIND_RETRY_DELAYS_S:
                try:
                    await client.bind_main_decode(rid, cached)
                    return
                except PeerError as exc:
                    if exc.code != "NOT_FOUND" or not run.current(Stage.PREFILL, stream):
                        log.warning("bind_failed", error=str(exc)[:200])
                        return
                await asyncio.sleep(delay_s)
            log.warning("bind_failed", error="prefill never knew the request")

        run.readers.append(asyncio.create_task(bind()))

    def _open_decode(
        self, run: Run, target: Instance, pipeline: Pipeline, resume: tuple[int, ...] = ()
    ) -> EventStream:
        job = run.job
        stream = self.peers.main_decode(target.ref.address).decode(
            DecodeJob(
                job.request_id,
                job.prompt_token_ids,
                run.stage_sampling(computes_prompt=pipeline is Pipeline.MD),
                job.cache_salt,
                pipeline,
                resume_token_ids=resume,
                burst_following=self._following(),
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
                run.stage_sampling(computes_prompt=False),
                job.cache_salt,
                plan.main_decode.ref,
                plan.handoff_mode,
                resume_token_ids=tuple(run.merge.emitted) if run.rerouted else (),
            )
        )
        run.calls.append(stream)
        run.relay_target = plan.main_decode.ref.instance_id
        return stream

    def _open_prefill(self, run: Run) -> EventStream:
        """Prefill's call; MainDecode's hit in it if MainDecode has accepted, else bound later."""
        job, plan = run.job, run.plan
        stream = self.peers.prefill(plan.prefill.ref.address).prefill(
            PrefillJob(
                job.request_id,
                job.prompt_token_ids,
                run.sampling,
                job.cache_salt,
                plan.pipeline,
                plan.main_decode.ref,
                None if run.md_unanswered else run.stats.md_cached_tokens,
                plan.relay.ref if plan.relay else None,
                burst_following=self._following(),
            )
        )
        run.calls.append(stream)
        run.prefill_target = plan.main_decode.ref.instance_id
        return stream

    def _routed(self, run: Run, tracker: RequestTracker) -> None:
        """Count and log the route chosen."""
        plan = run.plan
        tracker.routed(plan.pipeline.value, len(run.job.prompt_token_ids))
        if plan.reason is RouteReason.RELAY_FULL:
            RELAY_FULL.inc()
        est = plan.estimated_transfer_s
        log.info(
            "routed",
            pipeline=plan.pipeline.value,
            reason=plan.reason.value,
            predicted_hit=round(plan.predicted_hit_rate, 4),
            estimated_transfer_ms=None if est is None else round(est * 1000, 2),
            budget_ms=None if plan.budget_s is None else round(plan.budget_s * 1000, 2),
            prefill=run.stats.prefill_instance,
            relay=run.stats.relay_instance,
            main_decode=run.stats.main_decode_instance,
            main_decode_cluster=plan.main_decode.ref.cluster,
        )

    def _following(self) -> int:
        """Requests still being routed behind the one whose call opens now (a stage's hint)."""
        return max(0, self.routing_now - 1)

    def _read(self, run: Run, streams: list[tuple[Stage, EventStream]]) -> None:
        """Read ``streams`` into a fresh queue (what older readers left on theirs is dropped)."""
        run.queue = asyncio.Queue()
        run.readers, run.streaming = [], {}
        for stage, stream in streams:
            add_reader(run, stage, stream)

    async def _merged(self, run: Run) -> AsyncIterator[TokenEvent | FinalEvent]:
        # NOTE: every service ends its stream when its part is done (prefill after TransferDone,
        # relay after HandedOff/Finished, main_decode after Finished), so all ends = request done.
        # A migration replaces run.queue and run.streaming: read both afresh each time.
        # What a replaced or stopped call says is dropped (``Run.current``).
        # NOTE: tokens wait in ``ready`` while more items are already queued, and for one turn
        # of the event loop when none are: what a stage sent faster than the client reads goes
        # out as one event. The turn lets everything already runnable run first; on an idle
        # gateway that is microseconds and a token goes out alone, on a saturated one it is
        # the reads of the next engine steps, whose tokens then share this write — and while
        # each turn brings more, another turn, up to JOIN_HOLD_S after the oldest (one core
        # carried 31.8k tokens/s written one message each, ~39k with one turn, ~58k so:
        # ``pdd bench gateway``).
        # NOTE: nothing is yielded while MainDecode has not accepted (``run.md_unanswered``): a
        # refusal then is the client's whole answer, never a tail after a streamed token.
        ready: list[TokenEvent] = []
        hold_until = None  # while ``ready`` waits: its oldest token waits no longer than this
        arrived = False  # an item came off the queue since the last turn
        loop = asyncio.get_running_loop()
        while run.streaming:
            if ready and run.queue.empty() and not run.md_unanswered:
                now = loop.time()
                if hold_until is None or (arrived and now < hold_until):
                    # NOTE: one turn (above), and another while each brings more, up to
                    # JOIN_HOLD_S: a stream that gets a token every turn is written, not held.
                    hold_until = now + JOIN_HOLD_S if hold_until is None else hold_until
                    arrived = False
                    await asyncio.sleep(0)
                    continue
                for ev in delivered(run, ready):
                    yield ev
                ready, hold_until = [], None
            item = await run.queue.get()
            arrived = True
            if ready and not isinstance(item, StageEvent) and not run.md_unanswered:
                for ev in delivered(run, ready):  # NOTE: the tokens first, then a fault or an end
                    yield ev
                ready, hold_until = [], None
            match item:
                case StageEnded(stage=stage, stream=stream) if run.current(stage, stream):
                    del run.streaming[stage]
                    if stage is Stage.MAIN_DECODE and run.md_unanswered:
                        # NOTE: ended without accepting: as lost as a stream that broke
                        closed = "closed the stream before accepting the request"
                        await self._on_failed(run, stage, PeerError("UNAVAILABLE", closed, "md"))
                        continue
                    if stage is Stage.RELAY:
                        self.ledger.release_relay(run.job.request_id)
                        await self._relay_ended(run)
                case StageFailed(stage=stage, error=error, stream=stream) if run.current(
                    stage, stream
                ):
                    await self._on_failed(run, stage, error)
                case StageEvent(stage=stage, event=Accepted() as accepted, stream=stream) if (
                    run.current(stage, stream)
                ):
                    if stage is Stage.MAIN_DECODE and run.rehomed:
                        self.on_rehome_accepted(run, stream)
                    elif stage is Stage.MAIN_DECODE and run.md_unanswered:
                        self._bind(run, accepted)
                case StageEvent(stage=stage, event=event, stream=stream) if run.current(
                    stage, stream
                ):
                    if isinstance(event, FirstToken):
                        self.start_kv_deadline(run)
                    elif isinstance(event, TransferDone):
                        self.ledger.release_link(run.job.request_id)
                    ready.extend(apply_event(run, stage, event))
                    if isinstance(event, TransferDone) and event.fast_link == FAST_LINK_FAILED:
                        await self._fast_link_failed(run)
                case Rehomed(stream=stream):
                    await self._on_rehomed(run, stream)
                case KvDeadline():
                    await self._on_kv_deadline(run)
                case AskAgain() as again:
                    self.on_ask_again(run, again)
        for ev in delivered(run, ready):
            yield ev
        if run.pending is not None and run.finish is None:
            raise run.pending.error
        yield final_event(run)
