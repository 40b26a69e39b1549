"""vLLM's paged KV ↔ PDD's canonical tokens, for one tensor-parallel rank's head slice.

vLLM's CPU attention backend keeps one tensor per layer, ``[num_blocks, kv_heads, block_size,
2 * head_dim]``; the memory of one (block, head) is its K *dim-major* (``[head_dim, block_size]``,
the layout its vector kernel reads) followed by its V token-major (``[block_size, head_dim]``) —
found by locating known K/V values, and checked by tests against our engine's KV for the same
weights (fp32, the "vec" kernel of x86; the bf16 AMX kernel's layout is not exercised here).
The canonical layout (``pdd.engine.kv_wire``) is ``[layer, kv, token, head, dim]`` with *all* KV
heads; a rank of a TP group holds heads ``[rank * h, (rank + 1) * h)``, ``h = heads / tp`` (vLLM
splits KV heads evenly when ``heads >= tp``; with fewer heads than ranks each head is replicated
and rank r holds head ``r * heads // tp``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def _views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K ``[NB, H, D, BS]`` (dim-major) and V ``[NB, H, BS, D]`` views."""
    nb, heads, bs, two_d = layer.shape  # [NB, H, BS, 2D]
    dim = two_d // 2
    flat = layer.view(nb, heads, bs * two_d)
    k = flat[:, :, : bs * dim].view(nb, heads, dim, bs)
    v = flat[:, :, bs * dim :].view(nb, heads, bs, dim)
    return k, v


def read_tokens(layers: Sequence[torch.Tensor], slot_ids: torch.Tensor) -> torch.Tensor:
    """The rank's KV at ``slot_ids`` from every layer's paged tensor: ``[L, 2, n, h, D]``."""
    out = []
    for layer in layers:
        k, v = _views(layer)
        bs = v.shape[2]
        blk, off = slot_ids // bs, slot_ids % bs
        out.append(torch.stack([k[blk, :, :, off], v[blk, :, off, :]]))  # [2, n, h, D]
    return torch.stack(out)  # [L, 2, n, h, D]


def write_tokens(layers: Sequence[torch.Tensor], slot_ids: torch.Tensor, kv: torch.Tensor) -> None:
    """Write the rank's ``kv [L, 2, n, h, D]`` at ``slot_ids`` into every layer's paged tensor."""
    if kv.shape[0] != len(layers):
        raise ValueError(f"KV has {kv.shape[0]} layers, the cache {len(layers)}")
    for layer, src in zip(layers, kv):
        k, v = _views(layer)
        bs = v.shape[2]
        blk, off = slot_ids // bs, slot_ids % bs
        k[blk, :, :, off] = src[0].to(k.dtype)  # [n, h, D]
        v[blk, :, off, :] = src[1].to(v.dtype)


def check_layout(layer: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Refuse a paged layout other than the CPU backend's (GPU backends are not wired)."""
    if layer.dim() != 4 or layer.shape[1] != num_kv_heads or layer.shape[3] != 2 * head_dim:
        raise NotImplementedError(
            f"paged KV of shape {tuple(layer.shape)} is not vLLM's CPU layout "
            f"[blocks, {num_kv_heads} heads, block, 2 * {head_dim}]"
        )
