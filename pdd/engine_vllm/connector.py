"""``PddConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over PDD's ``KvStore``.

KV moves through PDD's links, not vLLM's: the connector only moves it between vLLM's paged cache
and the store that ``VllmEngine`` fills (imports) and exports from (saves).

Scheduler side (in vLLM's scheduler): a request carries its PDD key in
``kv_transfer_params`` (``{"pdd_key": ..., "pdd_save": bool}``).
``get_num_new_matched_tokens`` offers the imported positions past vLLM's own prefix hit (never
the last token: vLLM must compute one); each step's ``build_connector_meta`` names, per request,
its block table, the positions to load this step and the positions to save (everything from
what was saved so far up to what this step computes: a prefix-cache hit is saved too).

Worker side (in each worker, after/before the forward): ``start_load_kv`` writes the planned
imported positions (this rank's heads) into the paged cache; ``wait_for_save`` copies the
planned positions out of it into the store. Both are synchronous: on CPU a copy is cheap beside
the step, and it keeps the blocks' lifetime vLLM's own (``request_finished`` frees at once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdd.engine_vllm import kv_store, paged_kv

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass(frozen=True)
class RequestPlan:
    """One request's KV moves in one step."""

    key: str
    block_ids: tuple[int, ...]
    load: tuple[int, int] | None  # positions to write into the paged cache before the forward
    save: tuple[int, int] | None  # positions to copy out after it


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    store: str  # the KvStore of the engine that scheduled this step
    requests: list[RequestPlan] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one vLLM request the store knows."""

    key: str
    save: bool
    block_ids: list[int] = field(default_factory=list)
    saved_to: int = 0
    pending_load: int = 0


class PddConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._store_name = self._kv_transfer_config.get_from_extra_config("pdd_store", "")
        self._store = kv_store.lookup(self._store_name)
        self._block_size = vllm_config.cache_config.block_size
        self._tracked: dict[str, _Tracked] = {}  # scheduler side, by vLLM request id
        self._layers: list[torch.Tensor] = []  # worker side: this step's engine's paged KV
        self._heads = slice(None)
        self._rank = 0
        if role is KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._rank = get_tensor_model_parallel_rank()
            heads = vllm_config.model_config.get_total_num_kv_heads()
            self._heads = paged_kv.head_slice(
                heads, self._rank, get_tensor_model_parallel_world_size()
            )

    # --- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        key = params.get("pdd_key")
        have = self._store.import_range(key) if key else None
        if have is None:
            return 0, False
        start, end = have
        end = min(end, request.num_tokens - 1)  # NOTE: vLLM computes at least the last token
        # NOTE: below the import's start only vLLM's own cache can serve; if it lost some of that
        # (evicted since admission) the request is recomputed from its hit: slower, still right.
        if not start <= num_computed_tokens < end:
            return 0, False
        return end - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        key = params.get("pdd_key")
        if not key:
            return
        tracked = self._tracked.setdefault(
            request.request_id, _Tracked(key, bool(params.get("pdd_save")))
        )
        tracked.pending_load = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PddConnectorMetadata(self._store_name)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                meta.requests.append(
                    self._plan(tracked, new.num_computed_tokens, scheduled[new.req_id])
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
                tracked.saved_to = min(tracked.saved_to, cached.num_computed_tokens[i])
            elif new_ids:
                tracked.block_ids += new_ids[0]
            meta.requests.append(
                self._plan(tracked, cached.num_computed_tokens[i], scheduled[req_id])
            )
        return meta

    def _plan(self, tracked: _Tracked, num_computed: int, num_scheduled: int) -> RequestPlan:
        load = None
        if tracked.pending_load:
            load = (num_computed - tracked.pending_load, num_computed)
            tracked.pending_load = 0
        save = None
        if tracked.save:
            end = num_computed + num_scheduled
            if end > tracked.saved_to:
                save = (tracked.saved_to, end)
                tracked.saved_to = end
        return RequestPlan(tracked.key, tuple(tracked.block_ids), load, save)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None  # NOTE: saves are synchronous: vLLM may free the blocks now

    # --- worker side ---------------------------------------------------------------------------
    # NOTE: vLLM keeps ONE worker-side connector per process (a module global), shared by every
    # engine in it; so the paged KV is taken from the forward context of the engine that runs
    # this step (not from register_kv_caches), and the store from the step's metadata.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        self._layers = _paged_layers(forward_context)
        mc = self._vllm_config.model_config
        for layer in self._layers:
            paged_kv.check_layout(layer, layer.shape[1], mc.get_head_size())
        store = kv_store.lookup(meta.store)
        for plan in meta.requests:
            if plan.load is None:
                continue
            start, end = plan.load
            kv = store.import_slice(plan.key, start, end)[:, :, :, self._heads]
            slot_ids = paged_kv.slots(plan.block_ids, self._block_size, start, end)
            paged_kv.write_tokens(self._layers, slot_ids, kv)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # NOTE: start_load_kv wrote every layer already

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # NOTE: saved once per step, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        store = kv_store.lookup(meta.store)
        for plan in meta.requests:
            if plan.save is None:
                continue
            start, end = plan.save
            slot_ids = paged_kv.slots(plan.block_ids, self._block_size, start, end)
            kv = paged_kv.read_tokens(self._layers, slot_ids)
            store.save(plan.key, start, kv, self._heads, self._rank)


def _paged_layers(forward_context: ForwardContext) -> list[torch.Tensor]:
    """The running engine's paged KV per attention layer, in model order (``...layers.<i>...``)."""

    def index(name: str) -> int:
        match = re.search(r"\.(\d+)\.", name)
        return int(match.group(1)) if match else -1

    named = [
        (n, getattr(m, "kv_cache", None)) for n, m in forward_context.no_compile_layers.items()
    ]
    ordered = sorted(named, key=lambda item: index(item[0]))
    return [kv for _, kv in ordered if kv is not None and kv.dim() == 4]
