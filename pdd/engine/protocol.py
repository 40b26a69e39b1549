"""``EngineBackend``: the one boundary between the roles and an engine.

What prefill, relay and main_decode (and their ``EngineLoop``) ask of an engine, and nothing
more. Our PyTorch ``Engine`` implements it as it is; ``pdd.engine_vllm.VllmEngine`` implements
it over vLLM. Every method is called on the engine's one owner thread (``EngineLoop``).

The life of a request across it: ``add_request`` (paused: never scheduled until ``resume``, e.g.
while its KV arrives; ``keep_after_finish``: its KV stays exportable until ``release``) →
``import_kv`` of what another engine computed (positions from ``num_cached_tokens`` on) →
``append_tokens`` (extend with tokens produced elsewhere: append, or replace from a position for
catch-up) → ``step`` yields ``StepOutput``s by output position → ``export_kv`` of any computed
positions ``[a, b)`` in the canonical wire format (``kv_wire``) → ``abort`` / ``release``.
Cache events (``CacheEvent``, chained block hashes) go to the ``on_cache_event`` callback the
engine was built with; ``cache_snapshot`` restates the whole cache as "stored" events.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pdd.core.cache_event import CacheEvent
    from pdd.core.sampling_params import SamplingParams
    from pdd.engine.engine import StepOutput
    from pdd.engine.kv_wire import KvPayload
    from pdd.engine.model_config import ModelConfig


class EngineKind(enum.Enum):
    """Which engine a role runs on (``--engine``)."""

    PDD = "pdd"  # ours, pdd.engine.engine: the embedded default
    VLLM = "vllm"  # vLLM in the service's process, pdd.engine_vllm (the optional extra pdd[vllm])


@runtime_checkable
class EngineBackend(Protocol):
    # The model's shape (layers, KV heads, head dim: the KV wire layout), its KV pool.
    model_config: ModelConfig
    block_size: int
    num_blocks: int
    dtype: torch.dtype

    # --- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        salt: str = "",
        paused: bool = False,
        keep_after_finish: bool = False,
    ) -> None: ...

    def step(self) -> list[StepOutput]:
        """One scheduling step; the tokens it produced, each with its output position."""
        ...

    def append_tokens(
        self, request_id: str, token_ids: Sequence[int], start: int | None = None
    ) -> bool:
        """Make ``token_ids`` the outputs from ``start`` (default: the end); whether any were
        replaced (the engine had decoded past ``start`` on another path)."""
        ...

    def pause(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...

    def expedite(self, request_id: str) -> None:
        """A client waits on this request's next token: schedule it first (a hint)."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV; whether it was held."""
        ...

    def release(self, request_id: str) -> None:
        """Free what a finished ``keep_after_finish`` request still holds."""
        ...

    # --- KV ------------------------------------------------------------------------------------
    def export_kv(
        self, request_id: str, start: int, end: int, dtype: str | None = None
    ) -> KvPayload: ...

    def import_kv(self, request_id: str, payload: KvPayload) -> None: ...

    # --- what the loop and the roles read ------------------------------------------------------
    def has_schedulable(self) -> bool: ...

    def num_computed_total(self) -> int:
        """Tokens with KV over all held requests (unchanged by a step: it made no progress)."""
        ...

    def num_cached_tokens(self, request_id: str) -> int:
        """The request's tokens that have KV (after admission: its prefix hit)."""
        ...

    def holds_request(self, request_id: str) -> bool: ...

    def output_token_ids(self, request_id: str) -> list[int]: ...

    def prefix_match_len(self, token_ids: Sequence[int], salt: str = "") -> int:
        """How many leading tokens of ``token_ids`` the prefix cache holds."""
        ...

    def kv_usage(self) -> tuple[int, int]:
        """(blocks in use, total blocks)."""
        ...

    def request_counts(self) -> tuple[int, int, int]:
        """(running, waiting = queued for admission, paused) requests."""
        ...

    def cache_snapshot(self) -> list[CacheEvent]:
        """The prefix cache's content as "stored" events (kvstore rebuilds a dropped index)."""
        ...
