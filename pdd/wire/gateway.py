"""Converters for ``pdd.gateway.v1`` messages, with the request validation.

Every way a ``GenerateRequest`` can be wrong is rejected here with an
``InvalidArgumentError`` naming the field, before any service is called.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.request import FinalEvent, GenerateJob, RequestStats, TokenEvent, new_request_id
from pdd.engine import grammar
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.wire.common import (
    finish_to_pb,
    handoff_from_pb,
    handoff_to_pb,
    logprob_to_pb,
    pipeline_from_pb,
    pipeline_to_pb,
    sampling_fields_from,
    stage_to_pb,
)

_ID = re.compile(r"^[\x21-\x7e]{0,128}$")


def valid_id(value: str) -> bool:
    """Whether ``value`` may be a request or session id ("" included: none given)."""
    return _ID.match(value) is not None


def _check_id(value: str, field: str) -> str:
    if not valid_id(value):
        raise InvalidArgumentError(
            field, "must be at most 128 printable ASCII characters without spaces"
        )
    return value


def _check_tokens(ids: Sequence[int], vocab: int, field: str) -> None:
    for i, t in enumerate(ids):
        if t >= vocab:
            raise InvalidArgumentError(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary (size {vocab})"
            )


def generate_from_pb(msg: pb.GenerateRequest, info: ModelInfo) -> GenerateJob:
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "either prompt or prompt_token_ids is required")
    if which == "prompt":
        if not msg.prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        if info.encode is None:
            raise InvalidArgumentError(
                "prompt", f"model {info.name} has no tokenizer; send prompt_token_ids"
            )
        ids = list(info.encode(msg.prompt))
        if not ids:
            raise InvalidArgumentError("prompt", "tokenizes to no tokens")
    else:
        ids = list(msg.prompt_token_ids.token_ids)
        if not ids:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        _check_tokens(ids, info.vocab_size, "prompt_token_ids")
    ctx = info.max_context_tokens
    if len(ids) >= ctx:
        raise InvalidArgumentError(
            which, f"prompt has {len(ids)} tokens; the model's context is {ctx}"
        )
    if len(ids) + msg.max_tokens > ctx:
        raise InvalidArgumentError(
            "max_tokens",
            f"prompt ({len(ids)}) + max_tokens ({msg.max_tokens}) exceeds the model's context ({ctx})",
        )
    if msg.top_k > info.vocab_size:
        raise InvalidArgumentError("top_k", f"must be <= the vocabulary size {info.vocab_size}")
    _check_tokens(msg.stop_token_ids, info.vocab_size, "stop_token_ids")
    if msg.grammar:
        if info.encode is None:
            raise InvalidArgumentError(
                "grammar", f"model {info.name} has no tokenizer, so it cannot follow a grammar"
            )
        if error := grammar.validate(msg.grammar):
            raise InvalidArgumentError("grammar", f"does not compile: {error[:500]}")
    # NOTE: SamplingParams validates every sampling rule itself; only what needs the model
    # (context, vocabulary, tokenizer) is checked above.
    sampling = sampling_fields_from(msg, vocab_size=info.vocab_size)
    return GenerateJob(
        request_id=_check_id(msg.request_id, "request_id") or new_request_id(),
        prompt_token_ids=tuple(ids),
        sampling=sampling,
        session_id=_check_id(msg.session_id, "session_id"),
        cache_salt=_check_id(msg.cache_salt, "cache_salt"),
        force_pipeline=pipeline_from_pb(msg.force_pipeline, "force_pipeline"),
        handoff_mode=handoff_from_pb(msg.handoff_mode, "handoff_mode"),
    )


def stats_to_pb(s: RequestStats) -> pb.GenerateStats:
    return pb.GenerateStats(
        pipeline=pipeline_to_pb(s.pipeline),
        handoff_mode=handoff_to_pb(s.handoff_mode),
        prompt_tokens=s.prompt_tokens,
        completion_tokens=s.completion_tokens,
        rld_tokens=s.rld_tokens,
        md_tokens=s.md_tokens,
        predicted_hit_rate=s.predicted_hit_rate,
        md_cached_tokens=s.md_cached_tokens,
        wan_kv_bytes=s.wan_kv_bytes,
        ttft_ms=s.ttft_ms,
        handoff_at_token=s.handoff_at_token,
        prefill_instance=s.prefill_instance,
        relay_instance=s.relay_instance,
        main_decode_instance=s.main_decode_instance,
        prefill_cached_tokens=s.prefill_cached_tokens,
        e2e_ms=s.e2e_ms,
        wan_transfer_ms=s.wan_transfer_ms,
        migrations=s.migrations,
    )


def event_to_pb(
    ev: TokenEvent | FinalEvent, request_id: str, text: str = ""
) -> pb.GenerateResponse:
    if isinstance(ev, TokenEvent):
        msg = pb.GenerateResponse(
            token_ids=ev.token_ids,
            text=text,
            stage=stage_to_pb(ev.stage),
            start_position=ev.start_position,
            request_id=request_id,
        )
        # NOTE: once per streamed token: the (usual) empty logprobs cost nothing
        if ev.logprobs:
            msg.logprobs.extend(logprob_to_pb(lp) for lp in ev.logprobs)
        if ev.prompt_logprobs:
            msg.prompt_logprobs.extend(logprob_to_pb(lp) for lp in ev.prompt_logprobs)
        return msg
    return pb.GenerateResponse(
        finish_reason=finish_to_pb(ev.finish_reason),
        stats=stats_to_pb(ev.stats),
        request_id=request_id,
        start_position=ev.stats.completion_tokens,
    )


def model_info_to_pb(info: ModelInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model=info.name,
        max_context_tokens=info.max_context_tokens,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        has_tokenizer=info.encode is not None,
        chat_template=info.chat_template,
    )
