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
     says where it handed over, MainDecode continues from there;
  7. the final message carries finish reason and measured stats.
A client that goes away cancels every call, and each service frees the
request's KV when its call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import grpc
import structlog

from pdd.core.errors import FailedPreconditionError, UnavailableError
from pdd.core.instance import Instance
from pdd.core.pipeline import Pipeline
from pdd.core.request import Ending, FinalEvent, GenerateJob, RequestStats, TokenEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kv_pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as kv_grpc
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as p_grpc
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc
from pdd.routing.policy import NoInstanceError, Route, RoutingConfig, route
from pdd.server.interceptors import outgoing_metadata
from pdd.serving.channels import Channels
from pdd.telemetry.metrics import HANDOFFS, RequestTracker
from pdd.wire.common import (
    finish_from_pb,
    handoff_to_pb,
    instance_ref_from_pb,
    instance_ref_to_pb,
    logprob_from_pb,
    pipeline_to_pb,
    sampling_to_pb,
)
from pdd.wire.kvstore import load_from_pb

log = structlog.get_logger(__name__)

STAGE_PREFILL, STAGE_RELAY, STAGE_MD = (
    common_pb2.STAGE_PREFILL,
    common_pb2.STAGE_RELAY,
    common_pb2.STAGE_MAIN_DECODE,
)
_STAGE_NAMES = {STAGE_PREFILL: "prefill", STAGE_RELAY: "relay", STAGE_MD: "main_decode"}


@dataclass
class _Merge:
    """Orders token deltas from several stages by output position."""

    next_pos: int = 0
    pending: dict[int, tuple[int, int, Logprob | None]] = field(default_factory=dict)
    # Every token streamed so far, in order: the whole state a handoff needs besides KV.
    emitted: list[int] = field(default_factory=list)

    def add(
        self, start: int, tokens: list[int], stage: int, logprobs: Sequence[Logprob] = ()
    ) -> list[TokenEvent]:
        """``logprobs``: one per token, or none (the request did not ask for them)."""
        for i, tok in enumerate(tokens):
            pos = start + i
            if pos >= self.next_pos and pos not in self.pending:
                self.pending[pos] = (tok, stage, logprobs[i] if logprobs else None)
        out: list[TokenEvent] = []
        while self.next_pos in self.pending:
            tok, stage, lp = self.pending.pop(self.next_pos)
            self.emitted.append(tok)
            lps = () if lp is None else (lp,)
            if out and out[-1].stage == stage:
                last = out[-1]
                out[-1] = TokenEvent(
                    last.start_position, (*last.token_ids, tok), stage, (*last.logprobs, *lps)
                )
            else:
                out.append(TokenEvent(self.next_pos, (tok,), stage, lps))
            self.next_pos += 1
        return out


class Gateway:
    def __init__(
        self,
        kvstore_address: str,
        routing: RoutingConfig = RoutingConfig(),
        rng: random.Random | None = None,
        stage_timeout_s: float = 600.0,
    ) -> None:
        self.channels = Channels()
        self._kvstore_address = kvstore_address
        self.routing = routing
        self.rng = rng or random.Random()
        self.stage_timeout_s = stage_timeout_s

    async def close(self) -> None:
        await self.channels.close()

    @property
    def _kv(self) -> kv_grpc.KvstoreServiceStub:
        # NOTE: channels are made on first use, inside the server's event loop.
        return kv_grpc.KvstoreServiceStub(self.channels.get(self._kvstore_address))

    async def instances(self) -> list[Instance]:
        resp = await self._kv.ListInstances(kv_pb.ListInstancesRequest(), timeout=5.0)
        return [
            Instance(
                instance_ref_from_pb(i.ref),
                i.block_size,
                i.model,
                load_from_pb(i.load),
                i.last_heartbeat_ms,
            )
            for i in resp.instances
        ]

    async def plan(self, job: GenerateJob) -> Route:
        resp = await self._kv.PredictHits(
            kv_pb.PredictHitsRequest(
                prompt_token_ids=list(job.prompt_token_ids), cache_salt=job.cache_salt
            ),
            timeout=5.0,
            metadata=outgoing_metadata(),
        )
        instances = [
            Instance(
                instance_ref_from_pb(h.instance.ref),
                h.instance.block_size,
                h.instance.model,
                load_from_pb(h.instance.load),
            )
            for h in resp.hits
        ]
        cached = {h.instance.ref.instance_id: h.cached_tokens for h in resp.hits}
        try:
            return route(
                len(job.prompt_token_ids),
                instances,
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
                        tracker.tokens(
                            len(event.token_ids), _STAGE_NAMES.get(event.stage, "unknown")
                        )
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
        plan = await self.plan(job)
        stats = RequestStats(
            pipeline=plan.pipeline,
            handoff_mode=plan.handoff_mode,
            prompt_tokens=len(job.prompt_token_ids),
            predicted_hit_rate=plan.predicted_hit_rate,
            prefill_instance=plan.prefill.ref.instance_id
            if plan.pipeline is not Pipeline.MD
            else "",
            main_decode_instance=plan.main_decode.ref.instance_id,
            relay_instance=plan.relay.ref.instance_id if plan.relay else "",
        )
        tracker.routed(plan.pipeline.value, len(job.prompt_token_ids))
        log.info(
            "routed",
            pipeline=plan.pipeline.value,
            predicted_hit=round(plan.predicted_hit_rate, 4),
            prefill=stats.prefill_instance,
            relay=stats.relay_instance,
            main_decode=stats.main_decode_instance,
        )
        md_call = self._md_decode(job, sampling, plan)
        calls: list[grpc.aio.Call] = [md_call]
        queue: asyncio.Queue = asyncio.Queue()
        readers: list[asyncio.Task] = []
        try:
            relay_call = None
            firsts = [self._first(md_call, "main_decode")]
            if plan.pipeline is Pipeline.P_RLD_MD:
                relay_call = self._relay_decode(job, sampling, plan)
                calls.append(relay_call)
                firsts.append(self._first(relay_call, "relay"))
            # NOTE: MainDecode and the relay accept independently: one round trip, not two, before prefill.
            accepted, *_ = await asyncio.gather(*firsts)
            stats.md_cached_tokens = accepted.accepted.cached_tokens
            p_call = None
            if plan.pipeline is not Pipeline.MD:
                p_call = self._prefill(job, sampling, plan, stats.md_cached_tokens)
                calls.append(p_call)
            readers = [
                asyncio.create_task(self._pump(name, call, queue))
                for name, call in (
                    ("prefill", p_call),
                    ("main_decode", md_call),
                    ("relay", relay_call),
                )
                if call is not None
            ]
            async for event in self._merge(
                queue, stats, t0, len(readers), plan, job.request_id, sampling.logprobs is not None
            ):
                yield event
        finally:
            for task in readers:
                task.cancel()
            for call in calls:
                call.cancel()

    async def _merge(
        self,
        queue: asyncio.Queue,
        stats: RequestStats,
        t0: float,
        live: int,
        plan: Route,
        request_id: str,
        logprobs: bool,
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        merge = _Merge()
        relay_done = False
        finish: str | None = None
        completion_tokens: int | None = None
        # NOTE: every service ends its stream when its part is done (prefill after TransferDone,
        # relay after HandedOff/Finished, main_decode after Finished), so all ends = request done.
        while live:
            name, msg = await queue.get()
            if msg is None:
                live -= 1
                continue
            if isinstance(msg, BaseException):
                if name == "relay" and not relay_done:
                    # NOTE: the relay is gone mid-request: drive the handoff from the tokens streamed.
                    await self._take_over(plan, request_id, merge.emitted, msg)
                    stats.handoff_at_token = len(merge.emitted)
                    relay_done = True
                    continue
                raise msg
            events: list[TokenEvent] = []
            which = msg.WhichOneof("event")
            if which == "first_token":
                stats.prefill_cached_tokens = msg.first_token.cached_tokens
                first = msg.first_token
                if logprobs and not first.HasField("logprob"):
                    raise FailedPreconditionError(
                        f"{name} sent its token without the logprobs asked for"
                    )
                events = merge.add(
                    0,
                    [first.token_id],
                    STAGE_PREFILL,
                    [logprob_from_pb(first.logprob)] if logprobs else [],
                )
            elif which == "transfer_done":
                stats.wan_kv_bytes = msg.transfer_done.wan_kv_bytes
                stats.wan_transfer_ms = msg.transfer_done.wan_transfer_ms
            elif which == "tokens":
                delta = msg.tokens
                if logprobs and len(delta.logprobs) != len(delta.token_ids):
                    raise FailedPreconditionError(
                        f"{name} sent {len(delta.logprobs)} logprobs for "
                        f"{len(delta.token_ids)} tokens; the request asked for them"
                    )
                events = merge.add(
                    delta.start_position,
                    list(delta.token_ids),
                    delta.stage,
                    [logprob_from_pb(lp) for lp in delta.logprobs] if logprobs else [],
                )
            elif which == "handed_off":
                stats.handoff_at_token = msg.handed_off.at_position
                relay_done = True
            elif which == "finished":
                relay_done = relay_done or name == "relay"
                finish = finish_from_pb(msg.finished.finish_reason) or finish
                completion_tokens = max(completion_tokens or 0, msg.finished.completion_tokens)
            for ev in events:
                if ev.start_position == 0:
                    stats.ttft_ms = (time.perf_counter() - t0) * 1000
                stats.completion_tokens += len(ev.token_ids)
                if ev.stage == STAGE_RELAY:
                    stats.rld_tokens += len(ev.token_ids)
                elif ev.stage == STAGE_MD:
                    stats.md_tokens += len(ev.token_ids)
                yield ev
        if merge.pending or (completion_tokens is not None and merge.next_pos < completion_tokens):
            raise FailedPreconditionError(
                f"token stream has a gap: delivered {merge.next_pos} of {completion_tokens} tokens"
            )
        stats.e2e_ms = (time.perf_counter() - t0) * 1000
        yield FinalEvent(finish, stats)

    async def _take_over(
        self, plan: Route, request_id: str, tokens: list[int], cause: BaseException
    ) -> None:
        """Hand the request to MainDecode ourselves: token IDs are all it needs besides its KV."""
        log.warning("relay_lost_gateway_handoff", at=len(tokens), error=str(cause)[:200])
        HANDOFFS.labels(
            plan.handoff_mode.value if plan.handoff_mode else "one-shot", "gateway"
        ).inc()
        stub = md_grpc.MainDecodeServiceStub(self.channels.get(plan.main_decode.ref.address))
        request = md_pb.TokenHandoffRequest(
            request_id=request_id,
            start_position=0,
            token_ids=tokens,
            final=True,
            mode=handoff_to_pb(plan.handoff_mode),
        )
        async for _ in stub.TokenHandoff(
            iter([request]), metadata=outgoing_metadata(), timeout=self.stage_timeout_s
        ):
            pass

    async def _pump(self, name: str, call, queue: asyncio.Queue) -> None:
        # NOTE: read(), not `async for`: grpc.aio forbids mixing both on one call (_first used read()).
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                queue.put_nowait((name, msg))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                queue.put_nowait((name, exc))
        except Exception as exc:  # noqa: BLE001 — never let a stage's stream fail silently
            queue.put_nowait((name, exc))
        queue.put_nowait((name, None))

    async def _first(self, call, name: str):
        msg = await call.read()
        if msg is grpc.aio.EOF or msg.WhichOneof("event") != "accepted":
            raise UnavailableError(f"{name} closed the stream before accepting the request")
        return msg

    def _md_decode(self, job: GenerateJob, sampling: SamplingParams, plan: Route):
        stub = md_grpc.MainDecodeServiceStub(self.channels.get(plan.main_decode.ref.address))
        return stub.Decode(
            md_pb.DecodeRequest(
                request_id=job.request_id,
                prompt_token_ids=list(job.prompt_token_ids),
                sampling=sampling_to_pb(sampling),
                cache_salt=job.cache_salt,
                pipeline=pipeline_to_pb(plan.pipeline),
            ),
            metadata=outgoing_metadata(),
            timeout=self.stage_timeout_s,
        )

    def _relay_decode(self, job: GenerateJob, sampling: SamplingParams, plan: Route):
        assert plan.relay is not None
        stub = r_grpc.RelayServiceStub(self.channels.get(plan.relay.ref.address))
        return stub.Decode(
            r_pb.DecodeRequest(
                request_id=job.request_id,
                prompt_token_ids=list(job.prompt_token_ids),
                sampling=sampling_to_pb(sampling),
                cache_salt=job.cache_salt,
                main_decode=instance_ref_to_pb(plan.main_decode.ref),
                handoff_mode=handoff_to_pb(plan.handoff_mode),
            ),
            metadata=outgoing_metadata(),
            timeout=self.stage_timeout_s,
        )

    def _prefill(self, job: GenerateJob, sampling: SamplingParams, plan: Route, md_cached: int):
        stub = p_grpc.PrefillServiceStub(self.channels.get(plan.prefill.ref.address))
        return stub.Prefill(
            p_pb.PrefillRequest(
                request_id=job.request_id,
                prompt_token_ids=list(job.prompt_token_ids),
                sampling=sampling_to_pb(sampling),
                cache_salt=job.cache_salt,
                pipeline=pipeline_to_pb(plan.pipeline),
                relay=instance_ref_to_pb(plan.relay.ref) if plan.relay else None,
                main_decode=instance_ref_to_pb(plan.main_decode.ref),
                main_decode_cached_tokens=md_cached,
            ),
            metadata=outgoing_metadata(),
            timeout=self.stage_timeout_s,
        )
