"""Converters for ``pdd.main_decode.v1``: the decode job, its events, the token handoff and the
KV-readiness poll, both ways (the KV push's messages are ``pdd.kv.messages``')."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError
from pdd.core.stage_events import (
    Accepted,
    DecodeEvent,
    DecodeJob,
    Finished,
    HandoffAck,
    HandoffBatch,
    KvReadiness,
    Tokens,
)
from pdd.gen.common.v1 import common_pb2
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as pb
from pdd.wire.common import (
    finish_from_pb,
    finish_to_pb,
    handoff_from_pb,
    handoff_to_pb,
    pipeline_required,
    pipeline_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    stage_request_from_pb,
    tokens_from_pb,
    tokens_to_pb,
)


def job_to_pb(job: DecodeJob) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=job.request_id,
        prompt_token_ids=list(job.prompt_token_ids),
        sampling=sampling_to_pb(job.sampling),
        cache_salt=job.cache_salt,
        pipeline=pipeline_to_pb(job.pipeline),
        resume_token_ids=list(job.resume_token_ids),
        burst_following=job.burst_following,
    )


def job_from_pb(msg: pb.DecodeRequest, vocab: int) -> DecodeJob:
    """The decode job, validated (a resume: MD only, fewer than max_tokens — DecodeJob's rules —
    and inside the vocabulary)."""
    rid, prompt = stage_request_from_pb(msg, vocab)
    for i, t in enumerate(msg.resume_token_ids):
        if t >= vocab:
            raise InvalidArgumentError(
                f"resume_token_ids[{i}]", f"token id {t} is outside the vocabulary ({vocab})"
            )
    return DecodeJob(
        rid,
        prompt,
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        pipeline_required(msg.pipeline),
        tuple(msg.resume_token_ids),
        msg.burst_following,
    )


def event_to_pb(ev: DecodeEvent, instance_id: str, kind=pb.DecodeResponse, **fields):
    """``ev`` as a ``DecodeResponse``, or as another message with the same ``event`` oneof
    (``kind=pb.DecodeManyEvent``, its ``call_id`` in ``fields``)."""
    if isinstance(ev, Tokens):
        return kind(tokens=tokens_to_pb(ev, common_pb2.STAGE_MAIN_DECODE), **fields)
    if isinstance(ev, Accepted):
        return kind(
            accepted=pb.Accepted(instance_id=instance_id, cached_tokens=ev.cached_tokens),
            **fields,
        )
    return kind(
        finished=pb.Finished(
            finish_reason=finish_to_pb(ev.finish_reason),
            completion_tokens=ev.completion_tokens,
            md_tokens=ev.md_tokens,
            wan_kv_bytes_received=ev.wan_kv_bytes,
            extend_ms=ev.extend_ms,
        ),
        **fields,
    )


def event_from_pb(msg: pb.DecodeResponse | pb.DecodeManyEvent) -> DecodeEvent:
    which = msg.WhichOneof("event")
    if which == "accepted":
        return Accepted(msg.accepted.cached_tokens)
    if which == "tokens":
        return tokens_from_pb(msg.tokens)
    if which == "finished":
        f = msg.finished
        return Finished(
            finish_from_pb(f.finish_reason),
            f.completion_tokens,
            f.md_tokens,
            f.wan_kv_bytes_received,
            f.extend_ms,
        )
    raise FailedPreconditionError(
        f"main_decode sent an event this gateway does not know: {which!r}"
    )


def handoff_batch_to_pb(batch: HandoffBatch) -> pb.TokenHandoffRequest:
    return pb.TokenHandoffRequest(
        request_id=batch.request_id,
        start_position=batch.start_position,
        token_ids=list(batch.token_ids),
        final=batch.final,
        request_finished=batch.request_finished,
        mode=handoff_to_pb(batch.mode),
    )


def handoff_batch_from_pb(
    msg: pb.TokenHandoffRequest, index: int, vocab: int, stream_request_id: str = ""
) -> HandoffBatch:
    """The ``index``-th batch of a handoff stream, validated: its tokens inside the vocabulary,
    its request the stream's (``stream_request_id``, its first batch's; a stream hands over one
    request)."""
    if not msg.request_id:
        raise InvalidArgumentError(f"handoff[{index}].request_id", "must not be empty")
    if stream_request_id and msg.request_id != stream_request_id:
        raise InvalidArgumentError(
            f"handoff[{index}].request_id",
            f"{msg.request_id!r} is not the stream's request {stream_request_id!r}",
        )
    if not msg.token_ids and not msg.final:
        raise InvalidArgumentError(
            f"handoff[{index}].token_ids", "must not be empty in a non-final batch"
        )
    for i, t in enumerate(msg.token_ids):
        if t >= vocab:
            raise InvalidArgumentError(
                f"handoff[{index}].token_ids[{i}]",
                f"token id {t} is outside the vocabulary ({vocab})",
            )
    return HandoffBatch(
        msg.request_id,
        msg.start_position,
        tuple(msg.token_ids),
        msg.final,
        msg.request_finished,
        handoff_from_pb(msg.mode, f"handoff[{index}].mode"),
    )


def handoff_ack_to_pb(ack: HandoffAck) -> pb.TokenHandoffResponse:
    return pb.TokenHandoffResponse(
        extended_through=ack.extended_through,
        extend_ms=ack.extend_ms,
        computed_through=ack.computed_through,
        decode_interval_ms=ack.decode_interval_ms,
    )


def handoff_ack_from_pb(msg: pb.TokenHandoffResponse) -> HandoffAck:
    return HandoffAck(
        msg.extended_through, msg.computed_through, msg.extend_ms, msg.decode_interval_ms
    )


def kv_readiness_to_pb(r: KvReadiness) -> pb.WaitKvReadyResponse:
    return pb.WaitKvReadyResponse(ready=r.ready, decode_interval_ms=r.decode_interval_ms)


def kv_readiness_from_pb(msg: pb.WaitKvReadyResponse) -> KvReadiness:
    return KvReadiness(msg.ready, msg.decode_interval_ms)


# --- DecodeMany: many requests' Decode on one stream ---------------------------------------


@dataclass(frozen=True)
class StartCall:
    """Start ``job`` as the stream's call ``call_id``; ``timeout_s``: its deadline (None: none)."""

    call_id: int
    job: DecodeJob
    timeout_s: float | None


@dataclass(frozen=True)
class CancelCall:
    call_id: int


@dataclass(frozen=True)
class CallEnded:
    """A call's last item: how its ``Decode`` would have ended (``code`` a gRPC status name)."""

    code: str
    message: str = ""


def start_to_pb(start: StartCall) -> pb.DecodeManyRequest:
    ms = 0 if start.timeout_s is None else max(1, math.ceil(start.timeout_s * 1000))
    return pb.DecodeManyRequest(
        call_id=start.call_id, decode=job_to_pb(start.job), timeout_ms=min(ms, 2**32 - 1)
    )


def cancel_to_pb(cancel: CancelCall) -> pb.DecodeManyRequest:
    return pb.DecodeManyRequest(call_id=cancel.call_id, cancel=pb.DecodeCancel())


def call_id_from_pb(msg: pb.DecodeManyRequest) -> int:
    if msg.call_id == 0:
        raise InvalidArgumentError("call_id", "must be set (a positive number)")
    return msg.call_id


def many_request_from_pb(msg: pb.DecodeManyRequest, vocab: int) -> StartCall | CancelCall:
    """A ``DecodeMany`` request, validated (a start's job as ``job_from_pb`` validates it)."""
    call_id = call_id_from_pb(msg)
    which = msg.WhichOneof("action")
    if which == "cancel":
        return CancelCall(call_id)
    if which != "decode":
        raise InvalidArgumentError("action", "must be decode or cancel")
    timeout_s = msg.timeout_ms / 1000 if msg.timeout_ms else None
    return StartCall(call_id, job_from_pb(msg.decode, vocab), timeout_s)


def ended_to_pb(call_id: int, end: CallEnded) -> pb.DecodeManyEvent:
    code = grpc.StatusCode[end.code].value[0]
    return pb.DecodeManyEvent(call_id=call_id, end=pb.DecodeEnd(code=code, message=end.message))


def many_events_from_pb(msg: pb.DecodeManyResponse) -> list[tuple[int, DecodeEvent | CallEnded]]:
    """Each event of a ``DecodeMany`` message with the call it belongs to."""
    out: list[tuple[int, DecodeEvent | CallEnded]] = []
    for ev in msg.events:
        if ev.WhichOneof("event") == "end":
            out.append(
                (ev.call_id, CallEnded(_CODE_NAMES.get(ev.end.code, "UNKNOWN"), ev.end.message))
            )
        else:
            out.append((ev.call_id, event_from_pb(ev)))
    return out


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
