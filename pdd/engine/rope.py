"""Rotary position embedding: inverse frequencies (default, "linear", "llama3") and cos/sin tables.

Follows transformers' conventions exactly (``rotate_half`` on the two halves of a
head, cos/sin duplicated over both halves) so that the same checkpoint gives the
same numbers here and in the oracle.
"""

from __future__ import annotations

import math

import torch

from pdd.engine.model_config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies, ``[head_dim // 2]`` float32, with rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    kind, params = config.rope_type, config.rope_scaling or {}
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = (
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
        )
        old_len = float(
            params.get("original_max_position_embeddings", config.max_position_embeddings)
        )
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryTable:
    """cos/sin for every position below ``max_positions``, looked up per token.

    NOTE: ``sin`` is stored with its first half negated, so that ``apply_rotary``
    needs no negation: ``rotate_half(x) * sin == swap_halves(x) * signed_sin``,
    bit for bit (a sign flip is exact).
    """

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
    ):
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_frequencies(config)[None, :]  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(
            dtype=dtype, device=device
        )  # [P, D]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` → ``cos, signed_sin [N, 1, D]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [N, H, D]`` rotated by per-token ``cos``/``signed_sin [N, 1, D]`` (into ``out`` if given).

    ``out`` may be ``x`` itself: both inputs of the last op are fresh tensors.
    NOTE: mul then add, not ``addcmul``: its fused multiply-add rounds differently
    from transformers, and this path is bit-identical to it.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat(
        (x[..., half:], x[..., :half]), dim=-1
    )  # [N, H, D]: rotate_half without the sign
    return torch.add(x * cos, swapped.mul_(signed_sin), out=out)
