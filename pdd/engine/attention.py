"""Paged attention over the KV pool for one flattened batch of decode tokens and prefill chunks.

A step's tokens are laid out decode-first: rows ``[0, num_decode)`` are one new
token each of ``num_decode`` sequences, the rest are prefill chunks. Every layer
writes the new K/V into the pool at their slots, then

- decode rows: with ``decode_context_lens`` set, the compiled paged kernel
  (``paged_decode``) reads each sequence's K/V in place by its block table;
  otherwise (kernel off, unavailable, or not a CPU float32 pool) gathers the
  blocks into a contiguous copy and runs one batched SDPA with a key-length mask;
- prefill rows: the same with a causal mask *offset by the tokens already in
  the cache* (query ``i`` of a chunk starting at ``c`` sees keys ``<= c + i``);
  ``is_causal=True`` would be wrong whenever a cached prefix makes
  ``q_len != k_len``. A lone chunk with no cached prefix takes the fast path
  (``is_causal=True`` on its own K/V, no gather).

GQA never copies K/V: the query heads of a KV group are folded into the
query-length axis — decode ``[B, KV, G, D]``, chunks ``[Bp, KV, Tq * G, D]`` (their
mask has a row per query and head); the lone causal chunk uses SDPA's ``enable_gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdd.engine.kv_cache import KvCache
from pdd.engine.paged_decode import paged_decode


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each row's new K/V is written
    num_decode: int
    decode_block_tables: torch.Tensor | None = None  # [Bd, MB] (padding → any real block)
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, MB * bs] True = attend (gather path only)
    decode_context_lens: torch.Tensor | None = (
        None  # [Bd] int64; set ⇒ decode uses the paged kernel
    )
    prefill_block_tables: torch.Tensor | None = None  # [Bp, MBp]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Tq * G, MBp * bs]: row t * G + g is query t
    prefill_pad_index: torch.Tensor | None = None  # [Bp * Tq] prefill row of each padded query
    prefill_valid_index: torch.Tensor | None = None  # [Np] padded position of each prefill row
    prefill_causal_only: bool = False  # one chunk, nothing cached before it
    # Where the gathers land, set with the block tables. NOTE: reused by every layer of the
    # step (each layer's gather is consumed before the next one's): a fresh multi-MB tensor
    # per layer page-faults, which cost as much as the copy itself (measured ~2x on the gather).
    decode_gather_buffer: torch.Tensor | None = None  # [Bd * MB, bs, 2, KV, D]
    prefill_gather_buffer: torch.Tensor | None = None  # [Bp * MBp, bs, 2, KV, D]


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, cache: KvCache, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    """``q [N, H, D]`` and the new ``kv [N, 2, KV, D]`` → attention output ``[N, H, D]``."""
    cache.write(layer, meta.slot_mapping, kv)
    nd, n = meta.num_decode, q.shape[0]
    if nd == n:
        return _decode(q, cache, layer, meta)
    if nd == 0:
        return _prefill(q, kv, cache, layer, meta)
    return torch.cat(
        [_decode(q[:nd], cache, layer, meta), _prefill(q[nd:], kv[nd:], cache, layer, meta)]
    )


def _gather(
    blocks: torch.Tensor, table: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks [NB+1, bs, 2, KV, D]`` by ``table [B, MB]`` into ``out`` → K, V views ``[B, KV, MB * bs, D]``."""
    b, mb = table.shape
    _, bs, _, kv, d = blocks.shape
    torch.index_select(blocks, 0, table.reshape(-1), out=out)  # [B * MB, bs, 2, KV, D]
    out = out.view(b, mb * bs, 2, kv, d)  # [B, L, 2, KV, D]
    return out[:, :, 0].transpose(1, 2), out[:, :, 1].transpose(1, 2)  # [B, KV, L, D] each


def _decode(q: torch.Tensor, cache: KvCache, layer: int, meta: AttentionMetadata) -> torch.Tensor:
    if meta.decode_context_lens is not None:  # in place, no gather: [B, H, D]
        return paged_decode(
            q, cache.layer(layer), meta.decode_block_tables, meta.decode_context_lens
        )
    b, h, d = q.shape
    kv = cache.num_kv_heads
    keys, values = _gather(
        cache.layer(layer), meta.decode_block_tables, meta.decode_gather_buffer
    )  # [B, KV, L, D]
    qg = q.view(b, kv, h // kv, d)  # [B, KV, G, D]: a group's heads share one K/V head
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(b, h, d)  # [B, H, D]


def _prefill(
    q: torch.Tensor, kv: torch.Tensor, cache: KvCache, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    n, h, d = q.shape
    if meta.prefill_causal_only:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            kv[:, 0].transpose(0, 1).unsqueeze(0),  # [1, KV, T, D]
            kv[:, 1].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [T, H, D]
    mask = meta.prefill_mask
    kvh = cache.num_kv_heads
    g = h // kvh
    bp, tq = mask.shape[0], mask.shape[2] // g
    if meta.prefill_pad_index is not None:
        q = q.index_select(0, meta.prefill_pad_index)  # [Bp * Tq, H, D]
    # NOTE: as in decode, a KV group's query heads are folded into the query axis instead of
    # SDPA's enable_gqa, which repeats K/V per head: for short chunks that copy dominated.
    qg = (
        q.reshape(bp, tq, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(bp, kvh, tq * g, d)
    )  # [Bp, KV, Tq * G, D]
    keys, values = _gather(
        cache.layer(layer), meta.prefill_block_tables, meta.prefill_gather_buffer
    )  # [Bp, KV, L, D]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    out = (
        out.reshape(bp, kvh, tq, g, d).permute(0, 2, 1, 3, 4).reshape(bp * tq, h, d)
    )  # [Bp * Tq, H, D]
    if meta.prefill_valid_index is not None:
        out = out.index_select(0, meta.prefill_valid_index)  # [Np, H, D]
    return out
