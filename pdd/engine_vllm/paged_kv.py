"""vLLM's paged KV ↔ PDD's canonical tokens, for one tensor-parallel rank's head slice.

Every attention backend of vLLM 0.32 is handed, per layer, a *logical* view
``[blocks, kv_heads, block, C]`` of its cache (``C`` = K + V content of one head at one token);
the physical order of those axes (and of the layer axis, when layers share a buffer) is vLLM's
resolved ``KVCacheLayout`` — head-major ``LBHNC`` ("HND"), token-major ``LBNHC`` ("NHD"),
block-outermost cross-layer packings — and lives in the view's strides. What the content means
is the backend's, so a ``PagedLayout`` is chosen by the backend vLLM selected
(``layout_for(backend.get_name())``):

- ``SPLIT_CONTENT`` (FlashAttention, FlashInfer, Triton, FlexAttention, unquantized): a token's
  K is ``C[:head_dim]`` and its V ``C[head_dim:]`` (each backend's forward reads
  ``kv_cache.transpose(1, 2).split(head_size, -1)``); any stride order, since the view's strides
  carry it;
- ``CPU_PACKED`` (vLLM's CPU backend, ``LBHNC`` only): the memory of one (block, head) is its K
  *dim-major* (``[head_dim, block]``, the layout the "vec" kernel reads) followed by its V
  token-major (``[block, head_dim]``) — found by locating known K/V values, checked by tests
  against our engine's KV for the same weights (fp32, the "vec" kernel of x86; other CPU kernels,
  e.g. bf16 AMX, pack differently and are refused).

Anything else (ROCm's K/V head groups, quantized caches, MLA) is refused, naming the backend.
A view's block may be a *kernel* block smaller than the scheduler's (vLLM splits a block into
uniformly strided kernel blocks), so slots are decomposed by the view's own block size.

The canonical layout (``pdd.engine.kv_wire``) is ``[layer, kv, token, head, dim]`` with *all* KV
heads; a rank of a TP group holds heads ``[rank * h, (rank + 1) * h)``, ``h = heads / tp`` (vLLM
splits KV heads evenly when ``heads >= tp``; with fewer heads than ranks each head is replicated
and rank r holds head ``r * heads // tp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch


class PagedLayout(Enum):
    SPLIT_CONTENT = "split_content"
    CPU_PACKED = "cpu_packed"


# NOTE: names as each backend's ``get_name()`` returns them (vllm/v1/attention/backends/*.py).
BACKEND_LAYOUTS: dict[str, PagedLayout] = {
    "FLASH_ATTN": PagedLayout.SPLIT_CONTENT,
    "FLASHINFER": PagedLayout.SPLIT_CONTENT,
    "TRITON_ATTN": PagedLayout.SPLIT_CONTENT,
    "FLEX_ATTENTION": PagedLayout.SPLIT_CONTENT,
    "CPU_ATTN": PagedLayout.CPU_PACKED,
}
CPU_KERNELS = ("vec",)  # CPU kernels whose packing CPU_PACKED describes (``layer.isa``)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def layout_for(backend: str, cpu_kernel: str | None = None) -> PagedLayout:
    """The layout of the attention backend named ``backend`` (and, on CPU, its kernel)."""
    layout = BACKEND_LAYOUTS.get(backend)
    if layout is None:
        raise NotImplementedError(
            f"PDD's KV connector does not know the paged KV layout of vLLM's attention backend "
            f"{backend!r} (known: {', '.join(sorted(BACKEND_LAYOUTS))})"
        )
    if layout is PagedLayout.CPU_PACKED and cpu_kernel not in CPU_KERNELS:
        raise NotImplementedError(
            f"PDD's KV connector knows the CPU backend's packing for its {CPU_KERNELS} kernels, "
            f"not for {cpu_kernel!r}"
        )
    return layout


def head_slice(num_kv_heads: int, tp_rank: int, tp_size: int) -> slice:
    """The canonical KV heads that TP rank ``tp_rank`` of ``tp_size`` holds."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over TP {tp_size}")
        per = num_kv_heads // tp_size
        return slice(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank * num_kv_heads // tp_size  # NOTE: replicated heads: several ranks hold one
    return slice(head, head + 1)


def slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slot (block * block_size + offset) of each token in ``[start, end)``."""
    pos = torch.arange(start, end)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def check_layer(layer: torch.Tensor, layout: PagedLayout, head_dim: int) -> None:
    """Refuse a layer view ``layout`` cannot address (shape, dtype, strides)."""
    if layer.dim() != 4 or layer.shape[3] != 2 * head_dim:
        raise NotImplementedError(
            f"paged KV of shape {tuple(layer.shape)} is not [blocks, heads, block, 2 * {head_dim}]"
        )
    if layer.dtype not in _FLOATS:
        raise NotImplementedError(f"paged KV of dtype {layer.dtype}: quantized KV is not wired")
    _, heads, bs, two_d = layer.shape
    if layout is PagedLayout.CPU_PACKED and layer.stride()[1:] != (bs * two_d, two_d, 1):
        raise NotImplementedError(
            f"CPU paged KV with strides {layer.stride()}: each (block, head) page must be dense"
        )


def _views(layer: torch.Tensor, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V as ``[NB, H, BS, D]`` views of its memory (writes land in the cache)."""
    nb, heads, bs, two_d = layer.shape  # [NB, H, BS, 2D], any strides
    dim = two_d // 2
    if layout is PagedLayout.SPLIT_CONTENT:
        return layer[..., :dim], layer[..., dim:]
    s_block, s_head = layer.stride()[:2]
    base = layer.storage_offset()
    # one (block, head) page: K [D, BS] (dim-major), then V [BS, D]
    k = layer.as_strided((nb, heads, bs, dim), (s_block, s_head, 1, bs), base)
    v = layer.as_strided((nb, heads, bs, dim), (s_block, s_head, dim, 1), base + bs * dim)
    return k, v


def read_tokens(
    layers: Sequence[torch.Tensor], slot_ids: torch.Tensor, layout: PagedLayout
) -> torch.Tensor:
    """The rank's KV at ``slot_ids`` from every layer's paged view: ``[L, 2, n, h, D]`` on CPU."""
    out = []
    for layer in layers:
        k, v = _views(layer, layout)
        ids = slot_ids.to(layer.device)
        blk, off = ids // k.shape[2], ids % k.shape[2]
        out.append(torch.stack([k[blk, :, off], v[blk, :, off]]).cpu())  # [2, n, h, D]
    return torch.stack(out)  # [L, 2, n, h, D]


def write_tokens(
    layers: Sequence[torch.Tensor], slot_ids: torch.Tensor, kv: torch.Tensor, layout: PagedLayout
) -> None:
    """Write the rank's ``kv [L, 2, n, h, D]`` at ``slot_ids`` into every layer's paged view."""
    if kv.shape[0] != len(layers):
        raise ValueError(f"KV has {kv.shape[0]} layers, the cache {len(layers)}")
    for layer, src in zip(layers, kv):
        k, v = _views(layer, layout)
        ids = slot_ids.to(layer.device)
        blk, off = ids // k.shape[2], ids % k.shape[2]
        k[blk, :, off] = src[0].to(layer.device, k.dtype)  # [n, h, D]
        v[blk, :, off] = src[1].to(layer.device, v.dtype)
