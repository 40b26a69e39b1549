"""Fused elementwise ops of a decoder layer: RMSNorm (with the residual add), SiLU·mul, RoPE.

``csrc/fused_ops.cpp``, built with the engine's other kernels (``kernels``), does each in one
pass over memory and one dispatch, where eager PyTorch takes ~20 ops a layer: at a decode batch
the dispatches cost more than the arithmetic, and in prefill every op writes a fresh tensor.

A model uses them when ``EngineConfig.fused_ops`` is set (the default), it runs CPU float32,
``PDD_FUSED_OPS`` is not ``0`` (an operator's off switch) and the build succeeds; otherwise it
runs the eager ops (``model``). Which, and why, is logged once per reason.

Numbers: RoPE is bit-identical to the eager form (and so to transformers'). RMSNorm and SiLU sum
and exponentiate in another order than PyTorch's kernels, so they may differ in the last bit;
greedy tokens against the transformers oracle then differ only at a float near-tie, as the
prepacked matmuls already may (``tests/unit/test_engine_fused.py`` says so explicitly).
"""

from __future__ import annotations

import torch

from pdd.engine import kernels

ENV_SWITCH = "PDD_FUSED_OPS"
USE = kernels.Use(ENV_SWITCH, "fused_ops", "fused_ops_fallback", "fused", "eager")


def enabled(requested: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on this device and dtype should run the fused ops (building them if needed)."""
    return kernels.enabled(USE, requested, device, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [N, H]`` → ``(x * rsqrt(mean(x²) + eps)) * weight``, a new ``[N, H]``."""
    return torch.ops.pdd.rms_norm(x, weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` in place (``[N, H]``, contiguous); returns ``rms_norm(residual)``."""
    return torch.ops.pdd.add_rms_norm_(residual, delta, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [N, 2I]`` (gate, then up) → ``silu(gate) * up`` ``[N, I]``."""
    return torch.ops.pdd.silu_mul(x)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate ``x [N, R, D]`` in place by per-token ``cos``/``signed_sin`` (``[N, D]`` or ``[N, 1, D]``).

    The same arithmetic as ``rope.apply_rotary`` (two products, then their sum), bit for bit.
    """
    torch.ops.pdd.rope_(x, cos, signed_sin)
