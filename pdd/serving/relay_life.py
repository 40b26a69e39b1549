"""What the relay's request life is made of (``pdd.serving.relay``): its config, the MainDecode
peer it hands over to, the items on a request's mailbox besides the engine loop's, and the
request's own record (``RelayLife``)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdd.core.stage_events import HandedOff, HandoffAck, HandoffBatch, KvReadiness, RelayJob
from pdd.serving.stream_pacer import StreamPacer

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
    # MainDecode answering NOT_FOUND this soon after the relay admitted the request has not
    # seen it yet (the gateway opens both at once, MainDecode's call crosses the WAN, and the
    # relay's KV may come first): asked again, not taken as lost.
    main_decode_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.main_decode_grace_s < 0:
            raise ValueError(f"main_decode_grace_s: must be >= 0, got {self.main_decode_grace_s}")
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


class HandoffStream(Protocol):
    """One token handoff to MainDecode (``pdd.wire.call.HandoffCall``): batch in, ack out."""

    async def send(self, batch: HandoffBatch) -> HandoffAck: ...

    async def done(self, *, wait: bool = False) -> None: ...

    def cancel(self) -> None: ...


class MainDecodePeer(Protocol):
    """What the relay asks of the MainDecode it hands a request to (``MainDecodeClient``)."""

    async def wait_kv_ready(self, request_id: str, timeout_ms: int) -> KvReadiness: ...

    def token_handoff(self) -> HandoffStream: ...


# --- the relay's own mailbox items (beside the engine loop's StepOutput and StepFailed) ---------


@dataclass(frozen=True)
class KvReady:
    """MainDecode holds the request's KV; it decodes a token every ``interval_s`` (0: unknown)."""

    interval_s: float

    def __post_init__(self) -> None:
        if self.interval_s < 0:
            raise ValueError(f"interval_s: must be >= 0, got {self.interval_s}")


@dataclass(frozen=True)
class HandoffDone:
    """MainDecode took the request over: the relay's stream ends with ``handed_off``."""

    handed_off: HandedOff


@dataclass(frozen=True)
class Failed:
    """A task beside the stream (MainDecode's KV wait, the handoff) failed: so does the stream."""

    error: BaseException

    def __post_init__(self) -> None:
        if not isinstance(self.error, BaseException):
            raise ValueError(f"error: must be an exception, got {type(self.error).__name__}")


@dataclass
class RelayLife:
    """One request on the relay, from admission to handoff or finish."""

    job: RelayJob
    mailbox: asyncio.Queue
    md: MainDecodePeer
    tasks: list[asyncio.Task] = field(default_factory=list)
    # Outputs from this position on are the relay's own (before it: prefill's first token).
    own_from: int = 0
    # NOTE: the engine forgets a finished request; keep its outputs here.
    outputs: list[int] = field(default_factory=list)
    # Set once decoding starts (``_start``): its lead is what recent switches took by then.
    pacer: StreamPacer = field(init=False)
    # NOTE: the relay's share of TTFDT, logged with its first token: KV arrived → decoding → out.
    ttfdt_share: tuple[float, float] | None = None
    # NOTE: collected by a task of its own and stamped on arrival, also while the pacer
    # holds a token, so a held token is held from when it was computed.
    pending: collections.deque[tuple[float, object]] = field(default_factory=collections.deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # MainDecode was lost: decode on alone, no handoff (the gateway may take the request over).
    alone: bool = False
    # When the relay admitted it (monotonic): MainDecode's grace for not knowing it runs from here.
    admitted_at: float = field(default_factory=time.monotonic)


def post_outcome(mailbox: asyncio.Queue, task: asyncio.Task) -> None:
    """A task beside the stream ended: what it returned (or the error it raised) is mail."""
    if task.cancelled():
        return
    exc = task.exception()
    item = task.result() if exc is None else Failed(exc)
    if item is not None:
        mailbox.put_nowait(item)


def handoff_batch(
    job: RelayJob,
    outputs: Sequence[int],
    start: int,
    *,
    final: bool = False,
    request_finished: bool = False,
) -> HandoffBatch:
    """The handoff batch of ``outputs[start:]``."""
    return HandoffBatch(
        job.request_id,
        start,
        tuple(outputs[start:]),
        final=final,
        request_finished=request_finished,
        mode=job.handoff_mode,
    )
