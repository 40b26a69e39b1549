"""Converters for the stage services: ``pdd.prefill.v1``, ``pdd.relay.v1``, ``pdd.main_decode.v1``.

Requests are validated here (the field is named in the error); events of the
domain generators in ``pdd.serving`` become response messages here.
"""

from __future__ import annotations

from pdd.core import stage_events as se
from pdd.core.errors import InvalidArgumentError
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.stage_events import CacheReport
from pdd.gen.common.v1 import common_pb2
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.wire.common import (
    finish_to_pb,
    handoff_from_pb,
    handoff_to_pb,
    instance_ref_from_pb,
    logprob_to_pb,
    pipeline_from_pb,
    sampling_from_pb,
)


def _common(msg, vocab: int) -> tuple[str, tuple[int, ...]]:
    if not msg.request_id:
        raise InvalidArgumentError("request_id", "must not be empty")
    if not msg.prompt_token_ids:
        raise InvalidArgumentError("prompt_token_ids", "must not be empty")
    for i, t in enumerate(msg.prompt_token_ids):
        if t >= vocab:
            raise InvalidArgumentError(
                f"prompt_token_ids[{i}]", f"token id {t} is outside the vocabulary ({vocab})"
            )
    return msg.request_id, tuple(msg.prompt_token_ids)


def _pipeline(value: int) -> Pipeline:
    pipeline = pipeline_from_pb(value, "pipeline")
    if pipeline is None:
        raise InvalidArgumentError("pipeline", "must be P_MD, P_RLD_MD or MD")
    return pipeline


def prefill_job_from_pb(msg: p_pb.PrefillRequest, vocab: int) -> se.PrefillJob:
    rid, prompt = _common(msg, vocab)
    pipeline = _pipeline(msg.pipeline)
    if pipeline is Pipeline.MD:
        raise InvalidArgumentError(
            "pipeline", "MD requests are prefilled by MainDecode, not by a prefill instance"
        )
    relay = instance_ref_from_pb(msg.relay, "relay") if msg.HasField("relay") else None
    if not msg.HasField("main_decode"):
        raise InvalidArgumentError("main_decode", "is required")
    return se.PrefillJob(
        rid,
        prompt,
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        pipeline,
        instance_ref_from_pb(msg.main_decode, "main_decode"),
        msg.main_decode_cached_tokens,
        relay,
    )


def prefill_event_to_pb(ev: se.FirstToken | se.TransferDone) -> p_pb.PrefillResponse:
    if isinstance(ev, se.FirstToken):
        first = p_pb.FirstToken(
            token_id=ev.token_id,
            prompt_tokens=ev.prompt_tokens,
            cached_tokens=ev.cached_tokens,
            prefill_ms=ev.prefill_ms,
        )
        if ev.logprob is not None:
            first.logprob.CopyFrom(logprob_to_pb(ev.logprob))
        return p_pb.PrefillResponse(first_token=first)
    return p_pb.PrefillResponse(
        transfer_done=p_pb.TransferDone(
            relay_kv_bytes=ev.relay_kv_bytes,
            wan_kv_bytes=ev.wan_kv_bytes,
            relay_transfer_ms=ev.relay_transfer_ms,
            wan_transfer_ms=ev.wan_transfer_ms,
            wan_queue_ms=ev.wan_queue_ms,
            fast_link=ev.fast_link,
        )
    )


def relay_job_from_pb(msg: r_pb.DecodeRequest, vocab: int) -> se.RelayJob:
    rid, prompt = _common(msg, vocab)
    if not msg.HasField("main_decode"):
        raise InvalidArgumentError("main_decode", "is required")
    mode = handoff_from_pb(msg.handoff_mode, "handoff_mode") or HandoffMode.ONE_SHOT
    return se.RelayJob(
        rid,
        prompt,
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        instance_ref_from_pb(msg.main_decode, "main_decode"),
        mode,
    )


def _delta(ev: se.Tokens, stage: int) -> common_pb2.TokenDelta:
    return common_pb2.TokenDelta(
        start_position=ev.start_position,
        token_ids=list(ev.token_ids),
        stage=stage,
        logprobs=[logprob_to_pb(lp) for lp in ev.logprobs],
    )


def relay_event_to_pb(ev) -> r_pb.DecodeResponse:
    if isinstance(ev, se.Accepted):
        return r_pb.DecodeResponse(accepted=r_pb.Accepted())
    if isinstance(ev, se.Tokens):
        return r_pb.DecodeResponse(tokens=_delta(ev, common_pb2.STAGE_RELAY))
    if isinstance(ev, se.HandedOff):
        return r_pb.DecodeResponse(
            handed_off=r_pb.HandedOff(
                at_position=ev.at_position,
                mode=handoff_to_pb(ev.mode),
                rounds=ev.rounds,
                handoff_ms=ev.handoff_ms,
            )
        )
    return r_pb.DecodeResponse(
        finished=r_pb.Finished(
            finish_reason=finish_to_pb(ev.finish_reason), completion_tokens=ev.completion_tokens
        )
    )


def md_job_from_pb(msg: md_pb.DecodeRequest, vocab: int) -> se.DecodeJob:
    rid, prompt = _common(msg, vocab)
    return se.DecodeJob(
        rid, prompt, sampling_from_pb(msg.sampling), msg.cache_salt, _pipeline(msg.pipeline)
    )


def md_event_to_pb(ev, instance_id: str) -> md_pb.DecodeResponse:
    if isinstance(ev, se.Accepted):
        return md_pb.DecodeResponse(
            accepted=md_pb.Accepted(instance_id=instance_id, cached_tokens=ev.cached_tokens)
        )
    if isinstance(ev, se.Tokens):
        return md_pb.DecodeResponse(tokens=_delta(ev, common_pb2.STAGE_MAIN_DECODE))
    return md_pb.DecodeResponse(
        finished=md_pb.Finished(
            finish_reason=finish_to_pb(ev.finish_reason),
            completion_tokens=ev.completion_tokens,
            md_tokens=ev.md_tokens,
            wan_kv_bytes_received=ev.wan_kv_bytes,
            extend_ms=ev.extend_ms,
        )
    )


def handoff_from_request(
    msg: md_pb.TokenHandoffRequest, index: int
) -> tuple[str, int, list[int], bool]:
    if not msg.request_id:
        raise InvalidArgumentError(f"handoff[{index}].request_id", "must not be empty")
    if not msg.token_ids and not msg.final:
        raise InvalidArgumentError(
            f"handoff[{index}].token_ids", "must not be empty in a non-final batch"
        )
    return msg.request_id, msg.start_position, list(msg.token_ids), msg.final


def cache_report_to_pb(report: CacheReport, response_type):
    return response_type(
        cached_prefix_tokens=report.cached_prefix_tokens,
        kv_blocks_used=report.kv_blocks_used,
        kv_blocks_total=report.kv_blocks_total,
        request_holds_kv=report.request_holds_kv,
        block_size=report.block_size,
    )
