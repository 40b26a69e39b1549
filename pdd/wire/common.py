"""Converters for ``pdd.common.v1`` messages."""

from __future__ import annotations

import functools
import re

from pdd.core.errors import InvalidArgumentError, field_prefix
from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline, Stage
from pdd.core.sampling_params import (
    Logprob,
    SamplingParams,
)
from pdd.core.stage_events import CacheReport, Tokens
from pdd.gen.common.v1 import common_pb2

_ROLE_TO_PB = {
    Role.PREFILL: common_pb2.ROLE_PREFILL,
    Role.RELAY: common_pb2.ROLE_RELAY,
    Role.MAIN_DECODE: common_pb2.ROLE_MAIN_DECODE,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def role_to_pb(role: Role) -> int:
    return _ROLE_TO_PB[role]


def role_from_pb(value: int, field: str = "role", *, optional: bool = False) -> Role | None:
    if value == common_pb2.ROLE_UNSPECIFIED and optional:
        return None
    try:
        return _ROLE_FROM_PB[value]
    except KeyError:
        raise InvalidArgumentError(
            field, f"must be one of {sorted(r.value for r in Role)}"
        ) from None


def instance_ref_to_pb(ref: InstanceRef) -> common_pb2.InstanceRef:
    return common_pb2.InstanceRef(
        instance_id=ref.instance_id,
        address=ref.address,
        role=role_to_pb(ref.role),
        cluster=ref.cluster,
    )


# NOTE: what an instance's identity may hold, checked wherever one comes in from the wire: ids and
# cluster names become Redis keys (kvstore's hash tags: no braces) and metric labels; an address is
# a host (name, IPv4, or [IPv6]) and a port to dial. Lengths are bounded: every prediction answers
# every instance's record, so one bloated record would swell every routing answer.
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_CLUSTER = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ADDRESS = re.compile(r"([A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


def instance_id_from(value: str, field: str = "instance_id") -> str:
    """An instance id from the wire, validated (the one rule for every RPC that names one)."""
    if not value:
        raise InvalidArgumentError(field, "must not be empty")
    if not _INSTANCE_ID.fullmatch(value):
        raise InvalidArgumentError(
            field, f"must be 1-128 letters, digits or . _ : @ -; got {value[:64]!r}"
        )
    return value


def cluster_from(value: str, field: str = "cluster") -> str:
    """A cluster name from the wire, validated."""
    if not _CLUSTER.fullmatch(value):
        raise InvalidArgumentError(
            field, f"must be 1-64 letters, digits or . _ -; got {value[:64]!r}"
        )
    return value


def instance_ref_from_pb(msg: common_pb2.InstanceRef, field: str = "ref") -> InstanceRef:
    instance_id_from(msg.instance_id, f"{field}.instance_id")
    address = _ADDRESS.fullmatch(msg.address)
    if address is None or not 0 < int(address.group(2)) < 65536:
        raise InvalidArgumentError(
            f"{field}.address", f"expected host:port, got {msg.address[:300]!r}"
        )
    role = role_from_pb(msg.role, f"{field}.role")
    assert role is not None
    cluster = cluster_from(msg.cluster, f"{field}.cluster") if msg.cluster else "main"
    return InstanceRef(msg.instance_id, msg.address, role, cluster)


# --- sampling -------------------------------------------------------------


# NOTE: cached: a request's one SamplingParams goes to up to three stages (prefill, relay,
# MainDecode), and a grammar makes the message large. Callers copy it into their request
# message (protobuf copies on assignment) and never change it.
@functools.lru_cache(maxsize=256)
def sampling_to_pb(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=dict(sp.logit_bias),
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.grammar is not None:
        msg.grammar = sp.grammar
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    return msg


def sampling_from_pb(msg: common_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """A stage's sampling message, validated (the field named under ``field``)."""
    with field_prefix(field):
        return sampling_fields_from(msg)


def sampling_fields_from(msg, vocab_size: int | None = None) -> SamplingParams:
    """``SamplingParams`` from the fields the gateway's request and the stages' ``SamplingParams``
    message share (an unset top_p, 0, means 1.0: no truncation; an unset repetition_penalty 1.0).
    ``SamplingParams`` validates every rule itself; bias token ids are checked against
    ``vocab_size`` when given (the gateway knows the model; a stage's engine checks its own)."""
    for token in msg.logit_bias:
        if vocab_size is not None and token >= vocab_size:
            raise InvalidArgumentError(
                f"logit_bias[{token}]",
                f"token id {token} is outside the vocabulary (size {vocab_size})",
            )
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(msg.logit_bias.items()),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=msg.grammar or None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def logprob_to_pb(lp: Logprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
        rank=lp.rank or 0,
    )


def logprob_from_pb(msg: common_pb2.TokenLogprob) -> Logprob:
    return Logprob(msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)), msg.rank or None)


# --- enums ----------------------------------------------------------------

_PIPELINE = {
    Pipeline.P_MD: common_pb2.PIPELINE_P_MD,
    Pipeline.P_RLD_MD: common_pb2.PIPELINE_P_RLD_MD,
    Pipeline.MD: common_pb2.PIPELINE_MD,
}
_HANDOFF = {
    HandoffMode.ONE_SHOT: common_pb2.HANDOFF_MODE_ONE_SHOT,
    HandoffMode.CATCH_UP: common_pb2.HANDOFF_MODE_CATCH_UP,
}
_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def _from(table: dict, value: int, field: str, optional: bool):
    if value == 0 and optional:
        return None
    for k, v in table.items():
        if v == value:
            return k
    raise InvalidArgumentError(field, f"unknown value {value}")


def pipeline_to_pb(p: Pipeline | None) -> int:
    return _PIPELINE[p] if p is not None else common_pb2.PIPELINE_UNSPECIFIED


def pipeline_from_pb(
    value: int, field: str = "pipeline", *, optional: bool = True
) -> Pipeline | None:
    return _from(_PIPELINE, value, field, optional)


def handoff_to_pb(mode: HandoffMode | None) -> int:
    return _HANDOFF[mode] if mode is not None else common_pb2.HANDOFF_MODE_UNSPECIFIED


def handoff_from_pb(
    value: int, field: str = "handoff_mode", *, optional: bool = True
) -> HandoffMode | None:
    return _from(_HANDOFF, value, field, optional)


def finish_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_pb(value: int) -> str | None:
    return _from(_FINISH, value, "finish_reason", True)


# --- what the stage services share ------------------------------------------------------------


def stage_request_from_pb(msg, vocab: int) -> tuple[str, tuple[int, ...]]:
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


def pipeline_required(value: int) -> Pipeline:
    pipeline = pipeline_from_pb(value, "pipeline")
    if pipeline is None:
        raise InvalidArgumentError("pipeline", "must be P_MD, P_RLD_MD or MD")
    return pipeline


def tokens_to_pb(ev: Tokens, stage: int) -> common_pb2.TokenDelta:
    return common_pb2.TokenDelta(
        start_position=ev.start_position,
        token_ids=list(ev.token_ids),
        stage=stage,
        logprobs=[logprob_to_pb(lp) for lp in ev.logprobs],
        prompt_logprobs=[logprob_to_pb(lp) for lp in ev.prompt_logprobs],
    )


def tokens_from_pb(msg: common_pb2.TokenDelta) -> Tokens:
    # NOTE: once per streamed token at the gateway: the (usual) empty logprobs cost nothing
    if not msg.logprobs and not msg.prompt_logprobs:
        return Tokens(msg.start_position, tuple(msg.token_ids))
    return Tokens(
        msg.start_position,
        tuple(msg.token_ids),
        tuple(logprob_from_pb(lp) for lp in msg.logprobs),
        tuple(logprob_from_pb(lp) for lp in msg.prompt_logprobs),
    )


def cache_report_to_pb(report: CacheReport, response_type):
    return response_type(
        cached_prefix_tokens=report.cached_prefix_tokens,
        kv_blocks_used=report.kv_blocks_used,
        kv_blocks_total=report.kv_blocks_total,
        request_holds_kv=report.request_holds_kv,
        block_size=report.block_size,
    )


_STAGE = {
    Stage.PREFILL: common_pb2.STAGE_PREFILL,
    Stage.RELAY: common_pb2.STAGE_RELAY,
    Stage.MAIN_DECODE: common_pb2.STAGE_MAIN_DECODE,
}


def stage_to_pb(stage: Stage | None) -> int:
    return _STAGE[stage] if stage is not None else common_pb2.STAGE_UNSPECIFIED


def stage_from_pb(value: int, field: str = "stage", *, optional: bool = True) -> Stage | None:
    return _from(_STAGE, value, field, optional)
