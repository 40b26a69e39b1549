"""Converters for ``pdd.prefill.v1``: the prefill job and its events, both ways.

Requests are validated on the way in (the field is named in the error).
"""

from __future__ import annotations

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import FirstToken, PrefillEvent, PrefillJob, TransferDone
from pdd.gen.prefill.v1 import prefill_service_pb2 as pb
from pdd.wire.common import (
    instance_ref_from_pb,
    instance_ref_to_pb,
    logprob_from_pb,
    logprob_to_pb,
    pipeline_required,
    pipeline_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    stage_request_from_pb,
)


def job_to_pb(job: PrefillJob) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=job.request_id,
        prompt_token_ids=list(job.prompt_token_ids),
        sampling=sampling_to_pb(job.sampling),
        cache_salt=job.cache_salt,
        pipeline=pipeline_to_pb(job.pipeline),
        relay=instance_ref_to_pb(job.relay) if job.relay else None,
        main_decode=instance_ref_to_pb(job.main_decode),
        main_decode_cached_tokens=job.main_decode_cached_tokens or 0,
        main_decode_cached_tokens_later=job.main_decode_cached_tokens is None,
        burst_following=job.burst_following,
    )


def job_from_pb(msg: pb.PrefillRequest, vocab: int) -> PrefillJob:
    rid, prompt = stage_request_from_pb(msg, vocab)
    pipeline = pipeline_required(msg.pipeline)
    if pipeline is Pipeline.MD:
        raise InvalidArgumentError(
            "pipeline", "MD requests are prefilled by MainDecode, not by a prefill instance"
        )
    relay = instance_ref_from_pb(msg.relay, "relay") if msg.HasField("relay") else None
    if not msg.HasField("main_decode"):
        raise InvalidArgumentError("main_decode", "is required")
    return PrefillJob(
        rid,
        prompt,
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        pipeline,
        instance_ref_from_pb(msg.main_decode, "main_decode"),
        None if msg.main_decode_cached_tokens_later else msg.main_decode_cached_tokens,
        relay,
        msg.burst_following,
    )


def bind_to_pb(request_id: str, main_decode_cached_tokens: int) -> pb.BindMainDecodeRequest:
    return pb.BindMainDecodeRequest(
        request_id=request_id, main_decode_cached_tokens=main_decode_cached_tokens
    )


def bind_from_pb(msg: pb.BindMainDecodeRequest) -> tuple[str, int]:
    """(request id, MainDecode's cached prompt tokens); the count is checked against the
    request's prompt by prefill, which alone knows it."""
    if not msg.request_id:
        raise InvalidArgumentError("request_id", "is required")
    return msg.request_id, msg.main_decode_cached_tokens


def event_to_pb(ev: PrefillEvent) -> pb.PrefillResponse:
    if isinstance(ev, FirstToken):
        first = pb.FirstToken(
            token_id=ev.token_id,
            prompt_tokens=ev.prompt_tokens,
            cached_tokens=ev.cached_tokens,
            prefill_ms=ev.prefill_ms,
            prompt_logprobs=[logprob_to_pb(lp) for lp in ev.prompt_logprobs],
        )
        if ev.logprob is not None:
            first.logprob.CopyFrom(logprob_to_pb(ev.logprob))
        return pb.PrefillResponse(first_token=first)
    return pb.PrefillResponse(
        transfer_done=pb.TransferDone(
            relay_kv_bytes=ev.relay_kv_bytes,
            wan_kv_bytes=ev.wan_kv_bytes,
            relay_transfer_ms=ev.relay_transfer_ms,
            wan_transfer_ms=ev.wan_transfer_ms,
            wan_queue_ms=ev.wan_queue_ms,
            fast_link=ev.fast_link,
        )
    )


def event_from_pb(msg: pb.PrefillResponse) -> PrefillEvent:
    which = msg.WhichOneof("event")
    if which == "first_token":
        f = msg.first_token
        lp = logprob_from_pb(f.logprob) if f.HasField("logprob") else None
        prompt = tuple(logprob_from_pb(p) for p in f.prompt_logprobs)
        return FirstToken(f.token_id, f.prompt_tokens, f.cached_tokens, f.prefill_ms, lp, prompt)
    if which == "transfer_done":
        t = msg.transfer_done
        return TransferDone(
            t.relay_kv_bytes,
            t.wan_kv_bytes,
            t.relay_transfer_ms,
            t.wan_transfer_ms,
            t.wan_queue_ms,
            t.fast_link,
        )
    raise FailedPreconditionError(f"prefill sent an event this gateway does not know: {which!r}")
