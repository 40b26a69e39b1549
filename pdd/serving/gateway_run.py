"""One gateway request in flight (``Run``): its route, stage calls, merge and stats, the items
its stage readers put on its queue, and the folds of stage events into it.

``pdd.serving.gateway`` drives a ``Run``; everything here is plain state and pure steps on it,
so the merge rules (``apply_event``, ``final``) read apart from the request's control flow.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import structlog

from pdd.core.errors import FailedPreconditionError, PeerError, UnavailableError
from pdd.core.pipeline import Pipeline, Stage
from pdd.core.request import FinalEvent, GenerateJob, RequestStats, TokenEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.core.stage_events import (
    Accepted,
    DecodeEvent,
    Finished,
    FirstToken,
    HandedOff,
    PrefillEvent,
    RelayEvent,
    Tokens,
    TransferDone,
)
from pdd.core.token_runs import coalesce
from pdd.routing.policy import Route
from pdd.serving.gateway_peers import Cancellable
from pdd.serving.token_merge import TokenMerge
from pdd.wire.call import EventStream

log = structlog.get_logger(__name__)


# --- the request's queue: what each stage's reader task says --------------------------------


# NOTE: each item names the stream it came from: a stage's call can be replaced while the
# request goes on (MainDecode re-homed beside a relay that streams on), and what the old call
# says last must not end or fail the new one.


@dataclass(frozen=True)
class StageEvent:
    """One event of a stage's stream, as the peer client read it."""

    stage: Stage
    event: PrefillEvent | RelayEvent | DecodeEvent
    stream: object = None


@dataclass(frozen=True)
class StageFailed:
    """A stage's stream broke (its call was not cancelled by us)."""

    stage: Stage
    error: Exception
    stream: object = None


@dataclass(frozen=True)
class StageEnded:
    """A stage's stream is over (after its last event, or after ``StageFailed``)."""

    stage: Stage
    stream: object = None


@dataclass(frozen=True)
class Rehomed:
    """The MainDecode the request was re-homed on (``stream``: its call) holds the KV: take the
    request from the relay."""

    stream: object


@dataclass(frozen=True)
class KvDeadline:
    """A P-MD request's KV deadline passed (``Gateway.kv_deadline_s`` after its first token)."""


@dataclass(frozen=True)
class AskAgain:
    """The wait after the only MainDecode refused the request is over (``attempt``: which)."""

    attempt: int


StageItem = StageEvent | StageFailed | StageEnded | Rehomed | KvDeadline | AskAgain

MAIN_DECODE_LOST = "main_decode_lost"
PREFILL_LOST = "prefill_lost"


@dataclass(frozen=True)
class Loss:
    """A stage lost mid-request: why the request moves to another MainDecode, and the error it
    fails with if it cannot."""

    cause: str
    error: Exception

    def __post_init__(self) -> None:
        if self.cause not in (MAIN_DECODE_LOST, PREFILL_LOST):
            raise ValueError(f"cause: {MAIN_DECODE_LOST} or {PREFILL_LOST}, got {self.cause!r}")


@dataclass
class Run:
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
    # The tasks reading the stage streams into ``queue``, and each open stage's stream.
    readers: list[asyncio.Task] = field(default_factory=list)
    streaming: dict[Stage, EventStream] = field(default_factory=dict)
    # MainDecode instances lost for this request (never chosen again for it); a loss waiting
    # for the relay's stream to end before the request migrates (``stats.migrations``: so far).
    lost: set[str] = field(default_factory=set)
    pending: Loss | None = None
    # The MainDecode the relay hands over to, and the one prefill pushes to (instance ids);
    # ``rehomed``: MainDecode's call waits for the gateway's own handoff (``Rehomed``).
    relay_target: str = ""
    prefill_target: str = ""
    rehomed: bool = False
    # MainDecode has not accepted yet (prefill was opened without its hit): tokens wait here.
    md_unanswered: bool = False
    # Times the only MainDecode, full, was asked again (``Recovery._ask_again``).
    md_full_waits: int = 0
    # The relay finished the request without handing it to MainDecode (it took it for lost).
    relay_alone: bool = False
    # P-MD re-routed through the relay at its KV deadline: the relay resumes from what was
    # streamed and finishes the request.
    rerouted: bool = False
    # sampling.prompt_logprobs: what the stage that computed the prompt sent (tokens 1..n-1's)
    prompt_logprobs: tuple[Logprob, ...] | None = None

    def current(self, stage: Stage, stream: object) -> bool:
        """Whether ``stream`` is the stage's open call (not one replaced or stopped)."""
        return self.streaming.get(stage) is stream

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def stage_sampling(self, computes_prompt: bool) -> SamplingParams:
        """The sampling a stage is sent: prompt logprobs only for the one that computes the
        prompt (its prefix-cache hit is bypassed for them), and only while output 0 is unsent."""
        if self.sampling.prompt_logprobs is None or (computes_prompt and not self.merge.emitted):
            return self.sampling
        return replace(self.sampling, prompt_logprobs=None)

    def take_prompt_logprobs(self, logprobs: tuple[Logprob, ...]) -> None:
        if (
            self.sampling.prompt_logprobs is not None
            and self.prompt_logprobs is None
            and len(logprobs) == len(self.job.prompt_token_ids) - 1
        ):
            self.prompt_logprobs = logprobs

    def with_prompt(self, stage: Stage, events: list[TokenEvent]) -> list[TokenEvent]:
        """``events`` with the prompt's logprobs on the one carrying output position 0."""
        if self.sampling.prompt_logprobs is None or not events or events[0].start_position:
            return events
        if self.prompt_logprobs is None:
            raise FailedPreconditionError(
                f"{stage.value} sent output 0 without the prompt logprobs asked for"
            )
        return [replace(events[0], prompt_logprobs=self.prompt_logprobs), *events[1:]]


def stats_for(job: GenerateJob, plan: Route) -> RequestStats:
    return RequestStats(
        pipeline=plan.pipeline,
        handoff_mode=plan.handoff_mode,
        prompt_tokens=len(job.prompt_token_ids),
        predicted_hit_rate=plan.predicted_hit_rate,
        prefill_instance=plan.prefill.ref.instance_id if plan.pipeline is not Pipeline.MD else "",
        main_decode_instance=plan.main_decode.ref.instance_id,
        relay_instance=plan.relay.ref.instance_id if plan.relay else "",
    )


def add_reader(run: Run, stage: Stage, stream: EventStream) -> None:
    """Read ``stream`` into the request's queue as the stage's open call."""
    run.streaming[stage] = stream
    queue = run.queue
    if (pipe := getattr(stream, "pipe", None)) is not None:
        # NOTE: a shared decode stream hands its events straight into the queue (``_pump`` in its
        # reader task): one queue and one task switch less per token.
        pipe(
            lambda event: queue.put_nowait(StageEvent(stage, event, stream)),
            lambda exc: _ended(queue, stage, stream, exc),
        )
        return
    run.readers.append(asyncio.create_task(_pump(stage, stream, queue)))


async def _pump(stage: Stage, stream: EventStream, queue: asyncio.Queue[StageItem]) -> None:
    # NOTE: read(), not `async for`: grpc.aio forbids mixing both on one call (accepted read()).
    try:
        while (event := await stream.read()) is not None:
            queue.put_nowait(StageEvent(stage, event, stream))
    except Exception as exc:  # noqa: BLE001 — never let a stage's stream fail silently
        _ended(queue, stage, stream, exc)
    else:
        _ended(queue, stage, stream, None)


def _ended(
    queue: asyncio.Queue[StageItem], stage: Stage, stream: object, exc: Exception | None
) -> None:
    """The stage's stream ended: with ``exc`` a failure first, unless the call was cancelled
    here (a stopped or replaced call says nothing about its stage)."""
    if exc is not None and not (isinstance(exc, PeerError) and exc.cancelled):
        queue.put_nowait(StageFailed(stage, exc, stream))
    queue.put_nowait(StageEnded(stage, stream))


async def wait_accepted(stream: EventStream, stage: Stage) -> Accepted:
    event = await stream.read()
    if not isinstance(event, Accepted):
        raise UnavailableError(f"{stage.value} closed the stream before accepting the request")
    return event


def stop_calls(run: Run) -> None:
    """Cancel the request's readers and stage calls (each service frees the request's KV)."""
    for task in run.readers:
        task.cancel()
    for call in run.calls:
        call.cancel()
    run.readers, run.calls = [], []


def finish_here(run: Run, reason: str, loss: Loss) -> None:
    """End the request at the gateway: the client has every token and ``reason`` is known."""
    log.warning(
        "finished_at_gateway",
        instance=run.plan.main_decode.ref.instance_id,
        at=len(run.merge.emitted),
        finish_reason=reason,
        cause=loss.cause,
        error=str(loss.error)[:200],
    )
    run.finish, run.pending = reason, None
    run.completion_tokens = max(run.completion_tokens or 0, len(run.merge.emitted))
    run.streaming.clear()  # NOTE: every stream is cancelled: the merge loop ends here


def delivered(run: Run, ready: list[TokenEvent]) -> list[TokenEvent]:
    """``ready`` as it goes to the client now (runs coalesced), counted into the stats."""
    for ev in ready:
        count_tokens(run, ev)
    return coalesce(ready)


def count_tokens(run: Run, ev: TokenEvent) -> None:
    stats = run.stats
    if ev.start_position == 0:
        stats.ttft_ms = (time.perf_counter() - run.t0) * 1000
    stats.completion_tokens += len(ev.token_ids)
    if ev.stage is Stage.RELAY:
        stats.rld_tokens += len(ev.token_ids)
    elif ev.stage is Stage.MAIN_DECODE:
        stats.md_tokens += len(ev.token_ids)


def final_event(run: Run) -> FinalEvent:
    """The final event, once every stage ended: only if the merged stream has no gap."""
    merge, completion_tokens = run.merge, run.completion_tokens
    if merge.pending or (completion_tokens is not None and merge.next_pos < completion_tokens):
        raise FailedPreconditionError(
            f"token stream has a gap: delivered {merge.next_pos} of {completion_tokens} tokens"
        )
    run.stats.e2e_ms = (time.perf_counter() - run.t0) * 1000
    return FinalEvent(run.finish, run.stats)


def apply_event(run: Run, stage: Stage, event: object) -> list[TokenEvent]:
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
            run.take_prompt_logprobs(event.prompt_logprobs)
            return run.with_prompt(stage, run.merge.add(0, [event.token_id], Stage.PREFILL, lps))
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
            run.take_prompt_logprobs(event.prompt_logprobs)
            return run.with_prompt(
                stage, run.merge.add(event.start_position, event.token_ids, stage, lps)
            )
        case HandedOff():
            stats.handoff_at_token = event.at_position
            run.relay_done = True
        case Finished():
            run.relay_done = run.relay_done or stage is Stage.RELAY
            run.relay_alone = run.relay_alone or (stage is Stage.RELAY and event.alone)
            run.finish = event.finish_reason or run.finish
            run.completion_tokens = max(run.completion_tokens or 0, event.completion_tokens)
    return []
