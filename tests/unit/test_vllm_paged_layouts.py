"""``pdd.engine_vllm.paged_kv`` on synthetic paged caches of each backend's layout, without vLLM.

vLLM 0.32 allocates a cache group as one buffer whose axes ``[L, B, H, N, C]`` (layer, block,
KV head, token in block, content) lie in memory in the order of its resolved ``KVCacheLayout``
(a stride permutation), and hands each attention layer the logical view ``[B, H, N, C]`` of its
layer. Here every such cache is built the same way (a contiguous tensor in physical order,
permuted back), known K/V in the canonical layout are written through ``paged_kv`` for a TP
rank's heads at slots that cross block boundaries, and then:
- the whole buffer is compared with one built element by element, at flat offsets computed from
  the permutation (so the K/V landed where the backend's kernel reads it, and nothing else moved);
- the backend's own view of K/V (FlashAttention / FlashInfer / Triton:
  ``kv_cache.transpose(1, 2).split(head_dim, -1)``; CPU: each (block, head) page K dim-major
  then V) holds the values;
- ``read_tokens`` gives them back in the canonical layout.
Layout arithmetic on CPU tensors only: no GPU kernel runs here.
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine_vllm import paged_kv
from pdd.engine_vllm.paged_kv import PagedLayout

# vLLM's KVCacheLayout members: physical order of the logical axes (L, B, H, N, C) = (0..4)
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),  # head-major ("HND")
    "LBNHC": (0, 1, 3, 2, 4),  # token-major ("NHD")
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),  # layers packed in one block (cross-layer)
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
L, D, BS = 2, 4, 4  # layers, head dim, block size
NUM_BLOCKS = 8
BLOCK_IDS = (5, 2, 7, 0)  # a request's block table: not in order
START, END = 1, 14  # positions: cross three block boundaries


def _cache(order: tuple[int, ...], heads: int, dtype: torch.dtype, blocks: int, bs: int):
    """(physical buffer, per-layer logical views [B, H, N, 2D]) as vLLM lays a group out."""
    logical_shape = (L, blocks, heads, bs, 2 * D)
    phys = torch.zeros([logical_shape[a] for a in order], dtype=dtype)
    inverse = [order.index(a) for a in range(5)]
    logical = phys.permute(*inverse)  # [L, B, H, N, C]
    return phys, [logical[layer] for layer in range(L)]


def _flat_offset(phys: torch.Tensor, order: tuple[int, ...], index: tuple[int, ...]) -> int:
    """Where logical element ``index`` (l, b, h, n, c) lies in the contiguous physical buffer."""
    offset, stride = 0, 1
    for position in reversed(range(5)):
        offset += index[order[position]] * stride
        stride *= phys.shape[position]
    return offset


def _canonical(n: int, heads: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(L, 2, n, heads, D, generator=gen) + 3).to(dtype)  # never zero


def _expected_split(phys, order, kv, slot_ids, bs):
    """The buffer a SPLIT_CONTENT write must give: K at content [0, D), V at [D, 2D)."""
    flat = torch.zeros_like(phys).reshape(-1)
    for layer in range(L):
        for i, slot in enumerate(slot_ids.tolist()):
            b, n = divmod(slot, bs)
            for h in range(kv.shape[3]):
                for d in range(D):
                    flat[_flat_offset(phys, order, (layer, b, h, n, d))] = kv[layer, 0, i, h, d]
                    flat[_flat_offset(phys, order, (layer, b, h, n, D + d))] = kv[layer, 1, i, h, d]
    return flat.view(phys.shape)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout_name", sorted(STRIDE_ORDERS))
def test_gpu_backend_layouts_put_kv_where_the_kernel_reads_it(backend, layout_name):
    order, heads, dtype = STRIDE_ORDERS[layout_name], 2, torch.bfloat16
    layout = paged_kv.layout_for(backend)
    assert layout is PagedLayout.SPLIT_CONTENT
    phys, layers = _cache(order, heads, dtype, NUM_BLOCKS, BS)
    for layer in layers:
        paged_kv.check_layer(layer, layout, D)
    slot_ids = paged_kv.slots(BLOCK_IDS, BS, START, END)
    kv = _canonical(END - START, heads, dtype)  # [L, 2, n, h, D]
    paged_kv.write_tokens(layers, slot_ids, kv.float(), layout)  # converted to the cache's dtype

    assert torch.equal(phys, _expected_split(phys, order, kv, slot_ids, BS))
    for layer, (lk, lv) in zip(layers, kv):
        k_cache, v_cache = layer.transpose(1, 2).split(D, dim=-1)  # the kernels' [B, N, H, D]
        for i, slot in enumerate(slot_ids.tolist()):
            b, n = divmod(slot, BS)
            assert torch.equal(k_cache[b, n], lk[i]) and torch.equal(v_cache[b, n], lv[i])
    assert torch.equal(paged_kv.read_tokens(layers, slot_ids, layout), kv)


def test_cpu_backend_packs_k_dim_major_then_v_in_each_page():
    order, heads, dtype = STRIDE_ORDERS["LBHNC"], 2, torch.float32
    layout = paged_kv.layout_for("CPU_ATTN", "vec")
    assert layout is PagedLayout.CPU_PACKED
    phys, layers = _cache(order, heads, dtype, NUM_BLOCKS, BS)
    slot_ids = paged_kv.slots(BLOCK_IDS, BS, START, END)
    kv = _canonical(END - START, heads, dtype)
    paged_kv.write_tokens(layers, slot_ids, kv, layout)

    expected = torch.zeros_like(phys)
    for layer in range(L):
        for i, slot in enumerate(slot_ids.tolist()):
            b, n = divmod(slot, BS)
            for h in range(heads):
                page = expected[layer, b, h].reshape(-1)  # [BS * 2D]: K [D, BS], then V [BS, D]
                for d in range(D):
                    page[d * BS + n] = kv[layer, 0, i, h, d]
                    page[BS * D + n * D + d] = kv[layer, 1, i, h, d]
    assert torch.equal(phys, expected)
    assert torch.equal(paged_kv.read_tokens(layers, slot_ids, layout), kv)


@pytest.mark.parametrize(
    ("backend", "kernel"), [("FLASH_ATTN", None), ("TRITON_ATTN", None), ("CPU_ATTN", "vec")]
)
@pytest.mark.parametrize(("heads", "tp"), [(4, 2), (2, 2), (1, 2), (4, 4)])
def test_tp_ranks_each_hold_their_head_slice_and_together_all_heads(backend, kernel, heads, tp):
    """Each rank writes its head slice of the canonical all-heads KV into its own cache
    (``heads / tp`` heads, or one replicated head); reading every rank back gives the whole."""
    layout = paged_kv.layout_for(backend, kernel)
    order = STRIDE_ORDERS["LBHNC"] if layout is PagedLayout.CPU_PACKED else STRIDE_ORDERS["LBNHC"]
    kv = _canonical(END - START, heads, torch.float32, seed=heads * 10 + tp)
    slot_ids = paged_kv.slots(BLOCK_IDS, BS, START, END)
    got = torch.zeros_like(kv)
    for rank in range(tp):
        part = paged_kv.head_slice(heads, rank, tp)
        _, layers = _cache(order, part.stop - part.start, torch.float32, NUM_BLOCKS, BS)
        paged_kv.write_tokens(layers, slot_ids, kv[:, :, :, part], layout)
        back = paged_kv.read_tokens(layers, slot_ids, layout)
        assert torch.equal(back, kv[:, :, :, part])
        got[:, :, :, part] = back
    assert torch.equal(got, kv)


def test_head_slices():
    assert [paged_kv.head_slice(8, r, 4) for r in range(4)] == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
        slice(6, 8),
    ]
    assert [paged_kv.head_slice(2, r, 4) for r in range(4)] == [
        slice(0, 1),
        slice(0, 1),
        slice(1, 2),
        slice(1, 2),
    ]
    with pytest.raises(ValueError, match="do not split"):
        paged_kv.head_slice(6, 0, 4)
    with pytest.raises(ValueError, match="tp_rank"):
        paged_kv.head_slice(4, 2, 2)


def test_kernel_blocks_smaller_than_the_schedulers_block():
    """vLLM may split a block of 8 into kernel blocks of 4 (the view's block): scheduler block b
    is kernel blocks 2b and 2b + 1."""
    order, heads, layout = STRIDE_ORDERS["LBNHC"], 2, PagedLayout.SPLIT_CONTENT
    phys, layers = _cache(order, heads, torch.float32, NUM_BLOCKS * 2, BS)
    slot_ids = paged_kv.slots((3, 1), 2 * BS, 2, 13)  # scheduler blocks of 8 tokens
    kv = _canonical(11, heads, torch.float32)
    paged_kv.write_tokens(layers, slot_ids, kv, layout)
    kernel_slots = torch.tensor(
        [(3 if p < 8 else 1) * 2 * BS + (p % 8) for p in range(2, 13)]  # = kernel block * 4 + off
    )
    assert torch.equal(phys, _expected_split(phys, order, kv, kernel_slots, BS))
    assert torch.equal(paged_kv.read_tokens(layers, slot_ids, layout), kv)


def test_unknown_backends_and_caches_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="ROCM_ATTN"):
        paged_kv.layout_for("ROCM_ATTN")
    with pytest.raises(NotImplementedError, match="amx"):
        paged_kv.layout_for("CPU_ATTN", "amx")
    _, layers = _cache(STRIDE_ORDERS["LBHNC"], 2, torch.float32, NUM_BLOCKS, BS)
    with pytest.raises(NotImplementedError, match="2 \\* 8"):
        paged_kv.check_layer(layers[0], PagedLayout.SPLIT_CONTENT, 8)  # another head dim
    fp8 = torch.zeros(NUM_BLOCKS, 2, BS, 2 * D, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="quantized"):
        paged_kv.check_layer(fp8, PagedLayout.SPLIT_CONTENT, D)
    _, token_major = _cache(STRIDE_ORDERS["LBNHC"], 2, torch.float32, NUM_BLOCKS, BS)
    with pytest.raises(NotImplementedError, match="dense"):
        paged_kv.check_layer(token_major[0], PagedLayout.CPU_PACKED, D)  # CPU reads LBHNC only
