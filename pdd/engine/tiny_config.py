"""The ``ModelConfig`` of a ``tiny`` random model: its shape, without drawing its weights.

``tiny_model`` draws the weights for this config; the gateway, which needs only
the limits of a ``tiny:...`` model, stops here.
NOTE: no torch here: the gateway reads a tiny model's limits through this module.
"""

from __future__ import annotations

from typing import Any

from pdd.engine.model_config import ModelConfig

MIN_STD = 0.05


def tiny_config(
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    qkv_bias: bool = False,
    std: float = 0.1,
    eos_token_id: int | None = None,
) -> ModelConfig:
    """A Llama (or Qwen2 when ``qkv_bias``) config; ``std``, the weights' scale, is checked here too
    so that a spec the weights would reject is rejected where only the config is read."""
    if std < MIN_STD:
        raise ValueError(f"std must be >= {MIN_STD} so greedy logits are peaked, got {std}")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=qkv_bias,
        model_type="qwen2" if qkv_bias else "llama",
        torch_dtype="float32",
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
    )
