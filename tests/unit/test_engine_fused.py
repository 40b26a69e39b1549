"""The compiled fused ops (RMSNorm + residual, SiLU·mul, RoPE) against the eager ops they replace.

Like the paged kernel's tests, these fail when the build fails on a machine with a compiler and
are skipped only where no C++ compiler exists at all.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdd.engine import Engine, EngineConfig, SamplingParams, fused, kernels, tiny_model
from pdd.engine.attention import AttentionMetadata
from pdd.engine.kv_cache import KvCache
from pdd.engine.rope import RotaryTable, apply_rotary
from tests.conftest import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS

CKPT = tiny_model(11, num_layers=2, num_heads=8, num_kv_heads=2)


# rows × hidden: a decode batch, ragged widths (a vector tail), and a prefill past the
# size at which rows are split between threads
SHAPES = [(1, 512), (16, 512), (3, 37), (5, 16), (2048, 512), (700, 1000)]


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_rms_norm_matches_torch(rows, hidden):
    gen = torch.Generator().manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    before = x.clone()
    got = fused.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (hidden,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)  # only read


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_add_rms_norm_updates_the_residual_exactly_and_normalizes_the_sum(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    residual = torch.randn(rows, hidden, generator=gen)
    delta = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    expected_sum = residual + delta
    got = fused.add_rms_norm_(residual, delta, w, 1e-6)
    assert torch.equal(residual, expected_sum)  # the same float add as the eager x + delta
    torch.testing.assert_close(
        got, F.rms_norm(expected_sum, (hidden,), w, 1e-6), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("rows,inter", [(1, 1536), (16, 1536), (3, 21), (2048, 1536)])
def test_silu_mul_matches_torch_over_the_whole_range(rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, generator=gen) * 8
    x[0, :4] = torch.tensor([0.0, -0.0, 88.0, -100.0])  # zero, large, and exp's clamp
    expected = F.silu(x[:, :inter]) * x[:, inter:]
    torch.testing.assert_close(fused.silu_mul(x), expected, rtol=2e-6, atol=1e-30)
    strided = torch.randn(2 * inter, rows, generator=gen).t()  # not contiguous: copied first
    torch.testing.assert_close(
        fused.silu_mul(strided),
        F.silu(strided[:, :inter]) * strided[:, inter:],
        rtol=2e-6,
        atol=1e-30,
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 16, 1500])
def test_rope_is_bit_identical_to_the_eager_form_on_a_qkv_slice(head_dim, tokens):
    """q and k rotated in place inside the fused qkv output (a strided view), v left alone."""
    gen = torch.Generator().manual_seed(head_dim + tokens)
    h, kv = 8, 2
    qkv = torch.randn(tokens, h + 2 * kv, head_dim, generator=gen)
    cfg = tiny_model(0, num_heads=h, num_kv_heads=kv, hidden_size=h * head_dim).config
    cos, sin = RotaryTable(cfg, 4096, torch.float32, torch.device("cpu")).lookup(
        torch.randint(0, 4096, (tokens,), generator=gen)
    )  # [N, 1, D]
    eager, ours = qkv.clone(), qkv.clone()
    apply_rotary(eager[:, : h + kv], cos, sin, out=eager[:, : h + kv])
    fused.rope_(ours[:, : h + kv], cos, sin)
    assert torch.equal(ours, eager)
    assert torch.equal(ours[:, h + kv :], qkv[:, h + kv :])


def test_bad_inputs_are_refused_with_the_op_and_field_named():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[64\]"):
        fused.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be a CPU float32"):
        fused.rms_norm(x.double(), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm_: delta must have x's shape"):
        fused.add_rms_norm_(x, torch.ones(4, 32), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match=r"silu_mul: x must be \[N, 2I\]"):
        fused.silu_mul(torch.randn(4, 5))
    with pytest.raises(RuntimeError, match="rope_: head dim must be even"):
        fused.rope_(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="rope_: cos and signed_sin must hold"):
        fused.rope_(torch.randn(2, 3, 4), torch.randn(3, 4), torch.randn(3, 4))


def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 512, generator=gen)
    w = torch.randn(512, generator=gen)
    gate_up = torch.randn(2048, 3072, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((fused.rms_norm(x, w, 1e-5), fused.silu_mul(gate_up)))
    finally:
        torch.set_num_threads(before)
    for norm, act in outs[1:]:
        assert torch.equal(norm, outs[0][0]) and torch.equal(act, outs[0][1])


def _one_prefill_step(model, tokens: list[int]) -> torch.Tensor:
    """The model's logits for one lone causal chunk (no cached prefix) on a fresh pool."""
    cfg = model.config
    cache = KvCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    cos, sin = RotaryTable(cfg, 256, torch.float32, torch.device("cpu")).lookup(
        torch.arange(len(tokens))
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(tokens)) + 16, num_decode=0, prefill_causal_only=True
    )
    with torch.inference_mode():
        return model(torch.tensor(tokens), cos, sin, cache, meta, None)


def test_the_fused_forward_computes_the_eager_forwards_logits():
    engine = Engine(CKPT, EngineConfig(num_blocks=32))
    assert engine.model.fused
    tokens = [random.Random(1).randrange(256) for _ in range(40)]
    fused_logits = _one_prefill_step(engine.model, tokens)
    engine.model.use_fused(False)
    eager_logits = _one_prefill_step(engine.model, tokens)
    assert fused_logits.shape == (40, CKPT.config.vocab_size)
    torch.testing.assert_close(fused_logits, eager_logits, rtol=1e-4, atol=1e-4)


def test_engine_generates_the_same_with_and_without_the_fused_ops(llama_oracle):
    """Token-identical to the eager engine, except at an explicit near-tie of the oracle."""
    oracle = llama_oracle(CKPT)
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 45))] for _ in range(7)]
    config = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64)
    with_fused = Engine(CKPT, EngineConfig(**config))
    eager = Engine(CKPT, EngineConfig(**config, fused_ops=False))
    assert with_fused.model.fused and not eager.model.fused
    params = SamplingParams(max_tokens=24)
    oracle.assert_engines_agree(with_fused, eager, prompts, params)
    for prompt, ours in zip(prompts, with_fused.generate(prompts, params)):
        oracle.assert_greedy_equal(prompt, ours)


def test_env_switch_and_unsupported_dtypes_run_the_eager_ops(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert not Engine(CKPT, EngineConfig(num_blocks=16)).model.fused
    monkeypatch.delenv(fused.ENV_SWITCH)
    assert Engine(CKPT, EngineConfig(num_blocks=16)).model.fused
    bf16 = Engine(CKPT, EngineConfig(num_blocks=16, dtype="bfloat16"))
    assert not bf16.model.fused
    assert len(bf16.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]) == 3


def test_every_kernel_source_ships_in_the_package():
    """An installed engine compiles csrc/ at first use: every file the build reads (the sources
    and the header they include) must match the package data, or a wheel builds nothing."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["pdd.engine"]
    engine = root / "pdd" / "engine"
    needed = {p.relative_to(engine).as_posix() for p in (engine / "csrc").iterdir()}
    assert {s.relative_to(engine).as_posix() for s in kernels.SOURCES} <= needed
    assert "csrc/vec.h" in needed
    for path in needed:
        assert any(fnmatch.fnmatch(path, g) for g in globs), f"{path} is not package data"
