"""The engine's fast paths against their plain definitions: rotary, prepacked projections, greedy ties."""

from __future__ import annotations

import random

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.engine.linear import Linear, packing_supported
from pdd.engine.rope import RotaryTable, apply_rotary
from pdd.engine.sampling import sample

CKPT = tiny_model(5, num_layers=2, num_heads=4, num_kv_heads=2)


def test_rotary_is_bit_identical_to_transformers():
    """The signed-sin form rotates exactly as transformers' ``rotate_half`` form (a sign flip is exact)."""
    from transformers.models.llama.modeling_llama import rotate_half

    config = CKPT.config
    table = RotaryTable(config, 64, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 33, 63])
    x = torch.randn(5, 6, config.head_dim)  # [N, H, D]
    cos, signed_sin = table.lookup(positions)
    half = config.head_dim // 2
    sin = torch.cat(
        [-signed_sin[..., :half], signed_sin[..., half:]], dim=-1
    )  # the plain sin table
    expected = x * cos + rotate_half(x) * sin
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)
    inplace = x.clone()
    apply_rotary(inplace, cos, signed_sin, out=inplace)
    assert torch.equal(inplace, expected)


@pytest.mark.skipif(not packing_supported(torch.empty(1)), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_mm(bias):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    with torch.no_grad():
        layer.weight_t.normal_()
        if bias:
            layer.bias.normal_()
    assert layer.packed is None
    assert layer.pack()
    # decode sizes as they come; taller inputs padded (65 → 128, 300 → 384); 2,100 rows sliced
    for m in (1, 2, 16, 33, 65, 200, 300, 2100):
        x = torch.randn(m, 96)
        expected = x @ layer.weight_t + (layer.bias if bias else 0)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_packed_row_counts_stay_few():
    """oneDNN caches a primitive per row count: every input height maps to one of 81 counts."""
    counts = {Linear.padded_rows(rows) for rows in range(1, Linear.MAX_CALL_ROWS + 1)}
    assert len(counts) == 81
    for rows in range(1, Linear.MAX_CALL_ROWS + 1):
        assert rows <= Linear.padded_rows(rows) < rows + 128
    assert Linear.padded_rows(64) == 64 and Linear.padded_rows(65) == 128
    assert Linear.padded_rows(257) == 384 and Linear.padded_rows(2048) == 2048


@pytest.mark.parametrize("prepack", [True, False])
def test_batched_decode_matches_transformers_with_and_without_prepacking(prepack, llama_oracle):
    """Every matmul takes the prepacked weight when enabled, the plain one when not."""
    oracle = llama_oracle(CKPT)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    engine = Engine(CKPT, EngineConfig(num_blocks=96, prepack_weights=prepack))
    packed = [m.packed is not None for m in engine.model.modules() if isinstance(m, Linear)]
    assert all(packed) if prepack and packing_supported(torch.empty(1)) else not any(packed)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for prompt, ours in zip(prompts, outputs):
        oracle.assert_greedy_equal(prompt, ours)


def test_greedy_sampling_takes_the_first_of_tied_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    params = [SamplingParams()] * 3
    assert sample(logits, params, [0, 0, 0], [0, 0, 0]) == [1, 0, 0]
