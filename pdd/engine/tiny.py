"""Deterministic random-weight Llama checkpoints for tests and benchmarks.

Weights are drawn from one seeded generator with std >= 0.05 so greedy logits
are peaked (a random model with tiny weights would make every greedy choice a
near coin flip, and float noise between two correct implementations would flip
it). ``Checkpoint.save_hf`` writes the same weights as a Hugging Face directory
for the ``transformers`` oracle.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd.engine.checkpoint import Checkpoint
from pdd.engine.model_config import ModelConfig


def tiny_model(seed: int = 0, *, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 128,
               num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
               max_position_embeddings: int = 512, rope_theta: float = 10000.0,
               rope_scaling: dict[str, Any] | None = None, tie_word_embeddings: bool = False,
               qkv_bias: bool = False, std: float = 0.1, eos_token_id: int | None = None) -> Checkpoint:
    """A random Llama (or Qwen2 when ``qkv_bias``) checkpoint, identical for identical arguments."""
    if std < 0.05:
        raise ValueError(f"std must be >= 0.05 so greedy logits are peaked, got {std}")
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings, qkv_bias=qkv_bias,
        model_type="qwen2" if qkv_bias else "llama", torch_dtype="float32",
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
    )
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + randn(hidden_size)

    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen),
               "model.norm.weight": norm_weight()}
    if not tie_word_embeddings:
        weights["lm_head.weight"] = randn(vocab_size, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm_weight(),
            p + "post_attention_layernorm.weight": norm_weight(),
            p + "self_attn.q_proj.weight": randn(q, hidden_size),
            p + "self_attn.k_proj.weight": randn(kv, hidden_size),
            p + "self_attn.v_proj.weight": randn(kv, hidden_size),
            p + "self_attn.o_proj.weight": randn(hidden_size, q),
            p + "mlp.gate_proj.weight": randn(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": randn(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": randn(hidden_size, intermediate_size),
        })
        if qkv_bias:
            weights.update({p + f"self_attn.{x}_proj.bias": randn(n) for x, n in (("q", q), ("k", kv), ("v", kv))})
    return Checkpoint(config, weights, None, f"tiny_model(seed={seed})")
