"""Converters for ``pdd.relay.v1``: the relay job and its events, both ways (the fast link's
messages are ``pdd.kv.messages``')."""

from __future__ import annotations

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError
from pdd.core.pipeline import HandoffMode
from pdd.core.stage_events import Accepted, Finished, HandedOff, RelayEvent, RelayJob, Tokens
from pdd.gen.common.v1 import common_pb2
from pdd.gen.relay.v1 import relay_service_pb2 as pb
from pdd.wire.common import (
    finish_from_pb,
    finish_to_pb,
    handoff_from_pb,
    handoff_to_pb,
    instance_ref_from_pb,
    instance_ref_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    stage_request_from_pb,
    tokens_from_pb,
    tokens_to_pb,
)


def job_to_pb(job: RelayJob) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=job.request_id,
        prompt_token_ids=list(job.prompt_token_ids),
        sampling=sampling_to_pb(job.sampling),
        cache_salt=job.cache_salt,
        main_decode=instance_ref_to_pb(job.main_decode),
        handoff_mode=handoff_to_pb(job.handoff_mode),
        resume_token_ids=list(job.resume_token_ids),
    )


def job_from_pb(msg: pb.DecodeRequest, vocab: int) -> RelayJob:
    rid, prompt = stage_request_from_pb(msg, vocab)
    if not msg.HasField("main_decode"):
        raise InvalidArgumentError("main_decode", "is required")
    mode = handoff_from_pb(msg.handoff_mode, "handoff_mode") or HandoffMode.ONE_SHOT
    for i, t in enumerate(msg.resume_token_ids):
        if t >= vocab:
            raise InvalidArgumentError(
                f"resume_token_ids[{i}]", f"token id {t} is outside the vocabulary ({vocab})"
            )
    return RelayJob(
        rid,
        prompt,
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        instance_ref_from_pb(msg.main_decode, "main_decode"),
        mode,
        tuple(msg.resume_token_ids),
    )


def event_to_pb(ev: RelayEvent) -> pb.DecodeResponse:
    if isinstance(ev, Accepted):
        return pb.DecodeResponse(accepted=pb.Accepted())
    if isinstance(ev, Tokens):
        return pb.DecodeResponse(tokens=tokens_to_pb(ev, common_pb2.STAGE_RELAY))
    if isinstance(ev, HandedOff):
        return pb.DecodeResponse(
            handed_off=pb.HandedOff(
                at_position=ev.at_position,
                mode=handoff_to_pb(ev.mode),
                rounds=ev.rounds,
                handoff_ms=ev.handoff_ms,
            )
        )
    return pb.DecodeResponse(
        finished=pb.Finished(
            finish_reason=finish_to_pb(ev.finish_reason),
            completion_tokens=ev.completion_tokens,
            alone=ev.alone,
        )
    )


def event_from_pb(msg: pb.DecodeResponse) -> RelayEvent:
    which = msg.WhichOneof("event")
    if which == "accepted":
        return Accepted()
    if which == "tokens":
        return tokens_from_pb(msg.tokens)
    if which == "handed_off":
        h = msg.handed_off
        mode = handoff_from_pb(h.mode) or HandoffMode.ONE_SHOT
        return HandedOff(h.at_position, mode, h.rounds, h.handoff_ms)
    if which == "finished":
        f = msg.finished
        return Finished(finish_from_pb(f.finish_reason), f.completion_tokens, alone=f.alone)
    raise FailedPreconditionError(f"the relay sent an event this gateway does not know: {which!r}")
