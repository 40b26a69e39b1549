"""``EngineConfig``: pool size, batching limits, dtype and device of one engine."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pdd.engine.model_config import parse_dtype


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size; None → sized from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20
    max_num_batched_tokens: int = 2048  # the per-step token budget (decode tokens + prefill chunks)
    max_num_seqs: int = 64  # running (unpaused) requests at once
    max_model_len: int | None = None  # None → the model's max_position_embeddings
    dtype: str | None = None  # compute and KV dtype; None → the checkpoint's (float32 for GGUF)
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (CUDA when available)
    enable_prefix_caching: bool = True
    # CPU float32: multiply by a oneDNN-prepacked copy of every weight (2x weight memory;
    # prefill 2.2x and decode 1.3-3x faster than MKL's GEMM on the AMD host measured, linear.py)
    prepack_weights: bool = True
    # CPU float32 with AVX-512F: decode-sized matmuls (<= 64 rows) on a third copy of every weight
    # in 16-column panels, streamed with prefetch (`panel_gemm`; LM head 1.4x, gate_up 1.4x
    # faster than oneDNN's at 16 rows); oneDNN's when off, unsupported or the build fails
    panel_gemm: bool = True
    # CPU float32: decode attention reads K/V in place with the compiled paged kernel (`paged_decode`);
    # falls back to gather + SDPA when off, unsupported or the build fails
    paged_decode_kernel: bool = True
    # CPU float32: RMSNorm with the residual add, SiLU·mul and RoPE as compiled fused ops
    # (`fused`); eager PyTorch ops when off, unsupported or the build fails
    fused_ops: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {self.num_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be positive, got {self.kv_cache_bytes}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens: must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: must be positive, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return device
