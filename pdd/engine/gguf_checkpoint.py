"""Load a llama.cpp GGUF file (Llama or Qwen2 architecture) as a float32 ``Checkpoint``.

Every tensor is dequantized with the ``gguf`` package and renamed to its Hugging
Face name. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of
Llama models (interleaved RoPE pairs, its own rotary layout); we undo that
permutation exactly as transformers' GGUF loader does, so our RoPE (and the
oracle's) sees the original Hugging Face layout. The config is the metadata's
(``gguf_metadata``); the tokenizer (tokens, merges, special ids, chat template)
is rebuilt from the metadata by transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pdd.engine.checkpoint_record import Checkpoint
from pdd.engine.gguf_metadata import gguf_config

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q/k rows (as transformers' ``_reverse_permute_weights``)."""
    dim = w.shape[0] // n_head // 2
    # [H, D/2, 2, ...] → [H, 2, D/2, ...]: pairs (x_i, x_{i+D/2}) back from interleaved rows
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: str | Path, with_tokenizer: bool = True) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    reader = GGUFReader(str(path))
    config = gguf_config(reader)
    permute = config.model_type == "llama"
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
        # NOTE: a copy: F32 tensors come back as read-only views of the memory-mapped file
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permute and name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config.num_heads)
        elif permute and name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(w))
    tokenizer = None
    if with_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Checkpoint(config, weights, tokenizer, str(path))
