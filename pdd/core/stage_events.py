"""What the gateway asks of prefill, relay and MainDecode, and the events each one answers.

A stage's request life (``pdd.serving.<role>``) takes a job and yields these events; the wire
converters (``pdd.wire.stages``) and typed peer clients (``pdd.wire.peers``) turn them into
protobuf and back, so a role can be driven by an in-process peer as well as over gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import InstanceRef
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.sampling_params import Logprob, SamplingParams

# --- jobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str
    pipeline: Pipeline
    main_decode: InstanceRef
    # Prompt tokens MainDecode holds (the WAN delta starts there); None: not known yet — the
    # gateway opens prefill beside MainDecode's call and binds it once MainDecode accepts.
    main_decode_cached_tokens: int | None
    relay: InstanceRef | None = None
    # Requests the gateway was still routing behind this one (``EngineLoop.expect``).
    burst_following: int = 0

    @property
    def main_decode_cluster(self) -> str:
        """The remote cluster of the chosen MainDecode: prefill's WAN stream pool and link
        meter are per inter-cluster link, not per MainDecode. NOTE: carried on the wire in
        ``main_decode.cluster`` (``InstanceRef``), so it has no field of its own."""
        return self.main_decode.cluster


@dataclass(frozen=True)
class RelayJob:
    """A relay request. ``resume_token_ids``: the outputs already streamed (a P-MD request
    re-routed here when its KV could not cross the WAN in time): the relay prefills prompt +
    those itself, speaks from the next position and finishes the request alone (a fault path)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str
    main_decode: InstanceRef
    handoff_mode: HandoffMode
    resume_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.resume_token_ids) >= self.sampling.max_tokens:
            raise InvalidArgumentError(
                "resume_token_ids",
                f"{len(self.resume_token_ids)} outputs leave nothing to decode "
                f"(max_tokens={self.sampling.max_tokens})",
            )


@dataclass(frozen=True)
class DecodeJob:
    """A MainDecode request. ``resume_token_ids``: the outputs already streamed to the client
    (a request moved here from a lost stage): MainDecode makes them its outputs and prefills
    prompt + those locally (no KV is pushed). Pipeline MD: it speaks from position
    ``len(resume_token_ids)``. Pipeline P-RLD-MD (the relay still streams while its MainDecode
    was lost): it decodes on silently, says its KV is ready once that prefill is done, and
    speaks from where a handoff's final batch ends."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str
    pipeline: Pipeline
    resume_token_ids: tuple[int, ...] = ()
    # Requests the gateway was still routing behind this one (``EngineLoop.expect``).
    burst_following: int = 0

    def __post_init__(self) -> None:
        if self.resume_token_ids and self.pipeline is Pipeline.P_MD:
            raise InvalidArgumentError(
                "resume_token_ids", f"only with pipeline MD or P-RLD-MD, got {self.pipeline.value}"
            )
        if len(self.resume_token_ids) >= self.sampling.max_tokens:
            raise InvalidArgumentError(
                "resume_token_ids",
                f"{len(self.resume_token_ids)} outputs leave nothing to decode "
                f"(max_tokens={self.sampling.max_tokens})",
            )


# --- events -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FirstToken:
    """Prefill's sampled output position 0."""

    token_id: int
    prompt_tokens: int
    cached_tokens: int
    prefill_ms: float
    logprob: Logprob | None = None
    # sampling.prompt_logprobs: prompt tokens 1..n-1's (prefill computed the whole prompt)
    prompt_logprobs: tuple[Logprob, ...] = ()


# ``TransferDone.fast_link`` when prefill could not put the KV on the relay's fast link.
FAST_LINK_FAILED = "failed"


@dataclass(frozen=True)
class TransferDone:
    """Prefill shipped the request's KV: to the relay (fast link) and the delta to MainDecode."""

    relay_kv_bytes: int
    wan_kv_bytes: int
    relay_transfer_ms: float
    wan_transfer_ms: float
    wan_queue_ms: float
    fast_link: str


@dataclass(frozen=True)
class Accepted:
    """A decoding stage admitted the request; MainDecode says how much of the prompt it holds."""

    cached_tokens: int = 0


@dataclass(frozen=True)
class Tokens:
    """Output tokens from ``start_position`` on, from the stage that sent them."""

    start_position: int
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] = ()  # one per token when the request asked for them
    # prompt tokens 1..n-1's, from the stage that computed the prompt (MD's local prefill), once
    prompt_logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class HandedOff:
    """The relay handed the request to MainDecode after ``at_position`` outputs."""

    at_position: int
    mode: HandoffMode
    rounds: int
    handoff_ms: float


@dataclass(frozen=True)
class Finished:
    """The request ended on this stage (MainDecode also reports its own share and the WAN bytes)."""

    finish_reason: str | None
    completion_tokens: int
    md_tokens: int = 0
    wan_kv_bytes: int = 0
    extend_ms: float = 0.0
    # The relay finished without handing its tokens to MainDecode (it took MainDecode for lost).
    alone: bool = False


PrefillEvent = FirstToken | TransferDone
RelayEvent = Accepted | Tokens | HandedOff | Finished
DecodeEvent = Accepted | Tokens | Finished


# --- the handoff (relay or gateway → MainDecode) ------------------------------------------------


@dataclass(frozen=True)
class HandoffBatch:
    """Token ids for MainDecode to extend at output ``start_position`` (token ids only, never KV)."""

    request_id: str
    start_position: int
    token_ids: tuple[int, ...]
    final: bool = False
    # The request already finished upstream: MainDecode extends it into its DRC, emits nothing.
    request_finished: bool = False
    mode: HandoffMode | None = None


@dataclass(frozen=True)
class HandoffAck:
    extended_through: int
    computed_through: int
    extend_ms: float = 0.0
    decode_interval_ms: float = 0.0


@dataclass(frozen=True)
class KvReadiness:
    """Whether MainDecode holds a request's KV, and how long its decode steps take now."""

    ready: bool
    decode_interval_ms: float = 0.0


@dataclass(frozen=True)
class CacheReport:
    """An engine instance's answer to DescribeCache."""

    cached_prefix_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    request_holds_kv: bool
    block_size: int
