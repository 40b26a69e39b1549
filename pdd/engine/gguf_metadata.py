"""What a GGUF file's metadata says about its model: the ``ModelConfig``, read without its tensors' data.

``gguf_checkpoint`` adds the weights; the gateway needs only this.
NOTE: no torch here: the gateway reads a GGUF's limits through this module.
"""

from __future__ import annotations

from pdd.engine.model_config import ModelConfig


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    """The config of the model a ``gguf.GGUFReader`` reads: metadata and tensor names, no tensor data."""
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
        raise ValueError(
            "GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported"
        )
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
