"""``PddConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over PDD's ``KvStore``.

KV moves through PDD's links, not vLLM's: the connector only moves it between vLLM's paged cache
and the store that ``VllmEngine`` fills (imports) and exports from (saves).

Scheduler side (in vLLM's scheduler): a request carries its PDD key in
``kv_transfer_params`` (``{"pdd_key": ..., "pdd_save": bool}``).
``get_num_new_matched_tokens`` offers the imported positions past vLLM's own prefix hit (never
the last token: vLLM must compute one); each step's ``build_connector_meta`` names, per request,
its block table, the positions to load this step and the positions to save (everything from
what was saved so far up to what this step computes: a prefix-cache hit is saved too).

Worker side (in each worker — this process at TP 1, vLLM's worker processes at TP > 1 — after/
before the forward): ``start_load_kv`` writes the planned imported positions (this rank's heads)
into the paged cache; ``wait_for_save`` copies the planned positions out of it into the store.
The store is reached through the shared-memory segments the plan names (``kv_store``), never by
lookup, so every rank of a TP group reads and writes its own head slice of the same all-heads
KV. The paged layout is chosen by the attention backend vLLM selected (``paged_kv.layout_for``);
an unknown backend is refused when the KV caches are registered. Both moves are synchronous: a
copy is cheap beside the step, and it keeps the blocks' lifetime vLLM's own
(``request_finished`` frees at once); vLLM's executor returns a step only when every rank has
(its KV output aggregator waits for all), so the engine sees each rank's progress.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdd.engine_vllm import kv_store, paged_kv
from pdd.engine_vllm.kv_segment import KvSpec, SegmentRef

if TYPE_CHECKING:
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
    load_from: SegmentRef | None = None  # the request's imports
    save_to: SegmentRef | None = None  # the request's saves


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    spec: KvSpec  # what a token holds in the segments of the engine that scheduled this step
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
        self._block_size = vllm_config.cache_config.block_size
        self._tracked: dict[str, _Tracked] = {}  # scheduler side, by vLLM request id
        self._layers: list[torch.Tensor] = []  # worker side: this step's engine's paged KV
        self._layout = paged_kv.PagedLayout.SPLIT_CONTENT
        self._rank, self._tp_size = 0, 1
        if role is KVConnectorRole.SCHEDULER:  # NOTE: in the engine's process: the store is here
            name = self._kv_transfer_config.get_from_extra_config("pdd_store", "")
            self._store = kv_store.lookup(name)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._rank = get_tensor_model_parallel_rank()
            self._tp_size = get_tensor_model_parallel_world_size()

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
        meta = PddConnectorMetadata(self._store.spec)
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
        return RequestPlan(
            tracked.key,
            tuple(tracked.block_ids),
            load,
            save,
            self._store.import_ref(tracked.key) if load else None,
            self._store.save_ref(tracked.key) if save else None,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None  # NOTE: saves are synchronous: vLLM may free the blocks now

    # --- worker side ---------------------------------------------------------------------------
    # NOTE: vLLM keeps ONE worker-side connector per process (a module global), shared by every
    # engine in it; so the paged KV and its layout are taken from the forward context of the
    # engine that runs this step (register_kv_caches only checks them at start), and the store's
    # spec from the step's metadata.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Refuse, at start, an attention backend whose paged layout the connector does not know.

        NOTE: the layers are looked up in the config this connector was built with: another
        engine of the same process has layers of the same names on the same platform."""
        layers = self._vllm_config.compilation_config.static_forward_context
        mc = self._vllm_config.model_config
        for name, kv in kv_caches.items():
            if name in layers and isinstance(kv, torch.Tensor):
                layout = _layout_of(layers[name])
                paged_kv.check_layer(kv, layout, mc.get_head_size())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        self._layers, self._layout = _paged_layers(forward_context)
        for layer in self._layers:
            paged_kv.check_layer(layer, self._layout, meta.spec.head_dim)
        heads = paged_kv.head_slice(meta.spec.heads, self._rank, self._tp_size)
        for plan in meta.requests:
            if plan.load is None or plan.load_from is None:
                continue
            start, end = plan.load
            kv = kv_store.read_import(meta.spec, plan.load_from, start, end, heads)
            if kv is None:
                continue  # NOTE: released meanwhile (the request was aborted)
            slot_ids = paged_kv.slots(plan.block_ids, self._block_size, start, end)
            paged_kv.write_tokens(self._layers, slot_ids, kv, self._layout)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # NOTE: start_load_kv wrote every layer already

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # NOTE: saved once per step, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        heads = paged_kv.head_slice(meta.spec.heads, self._rank, self._tp_size)
        for plan in meta.requests:
            if plan.save is None or plan.save_to is None:
                continue
            start, end = plan.save
            slot_ids = paged_kv.slots(plan.block_ids, self._block_size, start, end)
            kv = paged_kv.read_tokens(self._layers, slot_ids, self._layout)
            kv_store.write_save(meta.spec, plan.save_to, start, kv, heads, self._rank)


def _layout_of(layer: Any) -> paged_kv.PagedLayout:
    """The paged layout of an attention layer's backend (and, on CPU, of its kernel)."""
    backend = layer.get_attn_backend().get_name()
    return paged_kv.layout_for(backend, getattr(layer, "isa", None))


def _paged_layers(
    forward_context: ForwardContext,
) -> tuple[list[torch.Tensor], paged_kv.PagedLayout]:
    """The running engine's paged KV per attention layer, in model order (``...layers.<i>...``),
    and their layout (one for all)."""

    def index(name: str) -> int:
        match = re.search(r"\.(\d+)\.", name)
        return int(match.group(1)) if match else -1

    layers, layouts = [], set()
    for name in sorted(forward_context.no_compile_layers, key=index):
        module = forward_context.no_compile_layers[name]
        kv = getattr(module, "kv_cache", None)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
            continue
        layers.append(kv)
        layouts.add(_layout_of(module))
    if len(layouts) > 1:
        raise NotImplementedError(f"paged KV in several layouts at once: {layouts}")
    return layers, layouts.pop() if layouts else paged_kv.PagedLayout.SPLIT_CONTENT
