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

from pdd.engine.checkpoint_record import Checkpoint
from pdd.engine.tiny_config import tiny_config


def tiny_model(seed: int = 0, *, std: float = 0.1, **shape: Any) -> Checkpoint:
    """Random weights (scale ``std``) for ``tiny_config(**shape)``, identical for identical arguments."""
    config = tiny_config(std=std, **shape)
    vocab_size, hidden_size, inter_size = (
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
    )
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + randn(hidden_size)

    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen),
        "model.norm.weight": norm_weight(),
    }
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = randn(vocab_size, hidden_size)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": norm_weight(),
                p + "post_attention_layernorm.weight": norm_weight(),
                p + "self_attn.q_proj.weight": randn(q, hidden_size),
                p + "self_attn.k_proj.weight": randn(kv, hidden_size),
                p + "self_attn.v_proj.weight": randn(kv, hidden_size),
                p + "self_attn.o_proj.weight": randn(hidden_size, q),
                p + "mlp.gate_proj.weight": randn(inter_size, hidden_size),
                p + "mlp.up_proj.weight": randn(inter_size, hidden_size),
                p + "mlp.down_proj.weight": randn(hidden_size, inter_size),
            }
        )
        if config.qkv_bias:
            weights.update(
                {
                    p + f"self_attn.{x}_proj.bias": randn(n)
                    for x, n in (("q", q), ("k", kv), ("v", kv))
                }
            )
    return Checkpoint(config, weights, None, f"tiny_model(seed={seed})")
