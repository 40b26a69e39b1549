"""The paged decode-attention kernel: decode queries read K/V in place from the pool by block table.

``csrc/paged_decode.cpp``, built with the engine's other kernels (``kernels``), registers
``torch.ops.pdd.paged_decode``.

An engine uses it when ``EngineConfig.paged_decode_kernel`` is set (the default), the pool is CPU
float32, ``PDD_PAGED_KERNEL`` is not ``0`` (an operator's off switch) and the build succeeds;
otherwise decode takes the gather + SDPA path of ``attention``. Which path, and why, is logged
once per reason.
"""

from __future__ import annotations

import math

import torch

from pdd.engine import kernels

ENV_SWITCH = "PDD_PAGED_KERNEL"
USE = kernels.Use(
    ENV_SWITCH, "paged_decode_kernel", "paged_decode_fallback", "paged_kernel", "gather_sdpa"
)


def enabled(requested: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine with this pool should decode with the kernel (building it if needed)."""
    return kernels.enabled(USE, requested, device, dtype)


def paged_decode(
    q: torch.Tensor, blocks: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """``q [B, H, D]`` against ``blocks [NB+1, bs, 2, KV, D]`` by ``block_tables [B, MB]`` → ``[B, H, D]``.

    Sequence ``b`` attends to its first ``context_lens[b]`` tokens; scale ``1/sqrt(D)`` as SDPA's.
    """
    return torch.ops.pdd.paged_decode(
        q, blocks, block_tables, context_lens, 1.0 / math.sqrt(q.shape[-1])
    )
