"""The decoder against transformers on the same weights: architectures, checkpoints, configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdd.engine import (
    Engine,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    load_checkpoint,
    tiny_model,
)
from pdd.engine.gguf_checkpoint import unpermute_rope_rows

PROMPTS = [[3, 17, 99, 4, 250, 8, 61], list(range(40, 77)), [5]]

CONFIGS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mha": dict(num_heads=4, num_kv_heads=4),
    "mqa_tied": dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
    "qwen2_qkv_bias": dict(qkv_bias=True),
    "llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "head_dim_32": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32),
}
CKPTS = {name: tiny_model(7, num_layers=2, **kw) for name, kw in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers_batch_1(name, llama_oracle):
    ckpt = CKPTS[name]
    oracle = llama_oracle(ckpt)
    engine = Engine(ckpt, EngineConfig(num_blocks=64))
    for prompt in PROMPTS:
        (ours,) = engine.generate([prompt], SamplingParams(max_tokens=12))
        oracle.assert_greedy_equal(prompt, ours)


def test_logits_match_transformers_closely(llama_oracle):
    """Not just argmax: the full next-token logits agree to float32 noise."""
    ckpt = CKPTS["gqa"]
    engine = Engine(ckpt, EngineConfig(num_blocks=16))
    prompt = PROMPTS[1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    _, logits, _ = engine.runner.run(batch)
    ref = llama_oracle(ckpt).next_logits(prompt)
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)


def test_hf_directory_round_trip(tmp_path, llama_oracle):
    ckpt = CKPTS["qwen2_qkv_bias"]
    loaded = load_checkpoint(ckpt.save_hf(tmp_path / "m"))
    assert loaded.config == ckpt.config
    assert loaded.weights.keys() == ckpt.weights.keys()
    engine = Engine(str(tmp_path / "m"), EngineConfig(num_blocks=32))
    (ours,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8))
    llama_oracle(ckpt).assert_greedy_equal(PROMPTS[0], ours)


def test_model_config_reads_transformers_4_rope_fields():
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [3, 4],
            "torch_dtype": "bfloat16",
        }
    )
    assert (cfg.rope_theta, cfg.rope_type, cfg.eos_token_ids, cfg.torch_dtype) == (
        5e5,
        "llama3",
        (3, 4),
        "bfloat16",
    )
    assert cfg.head_dim == 4 and cfg.num_kv_heads == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_heads=3, num_kv_heads=2),
        dict(hidden_size=0),
        dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
        dict(torch_dtype="float64"),
        dict(model_type="gpt2"),
    ],
)
def test_model_config_rejects_bad_values(bad):
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    with pytest.raises(ValueError):
        ModelConfig(**{**base, **bad})


def test_tiny_model_is_deterministic_and_peaked():
    a, b = tiny_model(3), tiny_model(3)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not torch.equal(a.weights["lm_head.weight"], tiny_model(4).weights["lm_head.weight"])
    with pytest.raises(ValueError, match="std"):
        tiny_model(0, std=0.01)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf ``permute`` followed by ours is the identity (q and GQA k)."""

    def llama_cpp_permute(w, n_head):
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    rng = np.random.default_rng(0)
    for heads in (9, 3):
        w = rng.standard_normal((heads * 64, 576)).astype(np.float32)
        back = unpermute_rope_rows(llama_cpp_permute(w, heads), heads)
        np.testing.assert_array_equal(back, w)
        assert not np.array_equal(llama_cpp_permute(w, heads), w)


def test_compute_dtype_override_bfloat16():
    engine = Engine(CKPTS["gqa"], EngineConfig(num_blocks=16, dtype="bfloat16"))
    assert engine.kv.data.dtype == torch.bfloat16
    assert engine.model.lm_head.weight_t.dtype == torch.bfloat16
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    assert len(out) == 4
