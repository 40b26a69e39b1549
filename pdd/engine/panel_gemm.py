"""Decode-sized matmuls on a copy of each weight in 16-column panels (``csrc/panel_gemm.cpp``).

A decode step multiplies a few rows (one per running request, at most ``Linear.MAX_EXACT_ROWS``
here) by every weight of the model, so every weight streams from memory once a step; oneDNN's
GEMM leaves the cores waiting on that stream between FMAs. The kernel walks each thread's
panels as one sequential stream and prefetches 32 KB ahead (numbers in the source and in
``docs/engine-performance.md``, "Decode matmuls on weight panels").

A model uses it when ``EngineConfig.panel_gemm`` is set (the default), it runs CPU float32, the
CPU has AVX-512F, ``PDD_PANEL_GEMM`` is not ``0`` (an operator's off switch) and the kernels
build; which, and why not, is logged once. Taller inputs (prefill) keep oneDNN's prepacked
weight, or ``weight_t`` without one. The cost is one more copy of every projection's weight.

Numbers: each output sums its products in ``k`` order with one fused multiply-add each, which
is oneDNN's own order at these row counts for ``K <= 512`` (bit-identical there, measured); a
taller ``K`` (the benchmark model's down projection, 1,536) differs in the last bits, so greedy
tokens against the transformers oracle may differ at a float near-tie, as oneDNN's already may.
"""

from __future__ import annotations

import torch

from pdd.engine import kernels

ENV_SWITCH = "PDD_PANEL_GEMM"
USE = kernels.Use(ENV_SWITCH, "panel_gemm", "panel_gemm_fallback", "panels", "onednn")
PANEL = 16  # columns a panel: one AVX-512 register of float32


def _unsupported() -> str:
    return "" if torch.ops.pdd.panel_gemm_supported() else "no_avx512f"


def enabled(requested: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode-sized matmuls here should run on the panel kernel (building it if needed)."""
    return kernels.enabled(USE, requested, device, dtype, _unsupported)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """``weight_t [K, N]`` → panels ``[ceil(N / 16), K, 16]``, the last one zero-padded."""
    k, n = weight_t.shape
    pad = -n % PANEL
    if pad:
        weight_t = torch.nn.functional.pad(weight_t, (0, pad))  # [K, N + pad]
    return weight_t.reshape(k, -1, PANEL).permute(1, 0, 2).contiguous()  # [NP, K, 16]


def linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [M, K] @ W + bias`` → ``[M, out_features]``, ``W`` being what ``pack`` was given."""
    return torch.ops.pdd.panel_linear(x, panels, bias, out_features)
