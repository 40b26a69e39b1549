"""A gateway request as the gateway's callers see it: the job, its events, its stats.

The gRPC and HTTP faces build a ``GenerateJob`` and read ``TokenEvent``s then one
``FinalEvent``; ``pdd.serving.gateway`` produces them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdd.core.pipeline import HandoffMode, Pipeline, Stage
from pdd.core.sampling_params import Logprob, SamplingParams


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class GenerateJob:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str = ""
    cache_salt: str = ""
    force_pipeline: Pipeline | None = None
    handoff_mode: HandoffMode | None = None


@dataclass
class RequestStats:
    pipeline: Pipeline | None = None
    handoff_mode: HandoffMode | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rld_tokens: int = 0
    md_tokens: int = 0
    predicted_hit_rate: float = 0.0
    md_cached_tokens: int = 0
    prefill_cached_tokens: int = 0
    wan_kv_bytes: int = 0
    wan_transfer_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    handoff_at_token: int = 0
    prefill_instance: str = ""
    relay_instance: str = ""
    main_decode_instance: str = ""
    # Times the request moved to another MainDecode (a stage lost mid-request).
    migrations: int = 0


@dataclass(frozen=True)
class TokenEvent:
    start_position: int
    token_ids: tuple[int, ...]
    stage: Stage
    logprobs: tuple[Logprob, ...] = ()  # one per token when the request asked for them
    # sampling.prompt_logprobs: prompt tokens 1..n-1's, on the event carrying output position 0
    prompt_logprobs: tuple[Logprob, ...] = ()


@dataclass
class Ending:
    """Why the caller closed a request's stream before its final event (e.g. "stop": a stop string)."""

    reason: str | None = None


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: str | None
    stats: RequestStats
