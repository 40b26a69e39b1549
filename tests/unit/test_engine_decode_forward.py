"""``decode_forward``: a decode step's whole forward in one compiled call (``csrc/decode_forward.cpp``).

It must give the fused Python forward's logits and KV bit for bit (the same ops in the same order),
be taken only when it can run (decode rows only, all sampled, prepacked weights, the paged
kernel), and refuse malformed inputs with the op and field named.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from tests.conftest import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


def _compare_every_forward(engine: Engine) -> list[tuple[bool, bool, bool]]:
    """Run each forward of ``engine`` both ways from the same pool; per forward: (one call
    taken, logits identical, pool identical). The engine goes on with the Python path's."""
    model, seen = engine.model, []
    real = model.forward

    def both(input_ids, cos, sin, cache, meta, logit_rows):
        before = cache.data.clone()
        one_call = real(input_ids, cos, sin, cache, meta, logit_rows)
        pool_one_call = cache.data.clone()
        cache.data.copy_(before)
        args, model._decode_args = model._decode_args, None
        try:
            python = real(input_ids, cos, sin, cache, meta, logit_rows)
        finally:
            model._decode_args = args
        took = meta.num_decode == input_ids.shape[0] and logit_rows is None
        seen.append((took, torch.equal(one_call, python), torch.equal(pool_one_call, cache.data)))
        return python

    model.forward = both
    return seen


@pytest.mark.parametrize(
    "batch,shape",
    [
        (1, dict(num_heads=8, num_kv_heads=2)),
        (16, dict(num_heads=8, num_kv_heads=2)),
        # past Linear.MAX_EXACT_ROWS: every projection multiplies zero-padded rows
        (70, dict(num_heads=4, num_kv_heads=4)),
        # Qwen2-style biases on q/k/v
        (9, dict(num_heads=4, num_kv_heads=1, qkv_bias=True)),
    ],
)
def test_one_call_gives_the_python_forwards_logits_and_kv_bit_for_bit(batch, shape):
    ckpt = tiny_model(5, num_layers=3, **shape)
    engine = Engine(ckpt, EngineConfig(num_blocks=512, block_size=4, max_num_seqs=128))
    assert engine.model._decode_args is not None
    seen = _compare_every_forward(engine)
    rng = random.Random(batch)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    decode_steps = [s for s in seen if s[0]]
    assert len(decode_steps) >= 5, seen
    assert all(logits and pool for _, logits, pool in seen), seen


def test_taken_only_where_it_can_run():
    ckpt = tiny_model(5, num_layers=2, num_heads=4, num_kv_heads=2)
    unpacked = Engine(ckpt, EngineConfig(num_blocks=64, prepack_weights=False))
    assert unpacked.model.fused and unpacked.model._decode_args is None
    eager = Engine(ckpt, EngineConfig(num_blocks=64, fused_ops=False))
    assert eager.model._decode_args is None
    one_call = Engine(ckpt, EngineConfig(num_blocks=64))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = eager.generate(prompts, params)
    assert unpacked.generate(prompts, params) == expected
    assert one_call.generate(prompts, params) == expected
    # re-packing renews the packed weights the one call multiplies by
    old = one_call.model._decode_args[0][1]
    one_call.model.pack_weights()
    assert one_call.model._decode_args[0][1] is not old
    assert one_call.model._decode_args[0][1] is one_call.model.layers[0].self_attn.qkv_proj.packed
    assert one_call.generate(prompts, params) == expected
    # and re-making the panels renews those (each projection's four, then the LM head's)
    one_call.model.pack_panels()
    qkv = one_call.model.layers[0].self_attn.qkv_proj
    assert one_call.model._decode_args[2][0] is qkv.panels is not None
    assert one_call.model._decode_args[2][-1] is one_call.model.lm_head.panels
    assert one_call.generate(prompts, params) == expected


def test_malformed_inputs_are_refused_naming_the_op_and_field():
    engine = Engine(tiny_model(5, num_layers=2), EngineConfig(num_blocks=16))
    model, cache = engine.model, engine.runner.cache
    weights, biases, panels = model._decode_args
    ids = torch.tensor([1, 2])
    cos = sin = torch.zeros(2, 1, model.config.head_dim)
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)

    def call(
        weights=weights,
        biases=biases,
        panels=panels,
        kv=cache.data,
        num_heads=model.config.num_heads,
    ):
        return torch.ops.pdd.decode_forward(
            ids, cos, sin, model.embed_tokens.weight, weights, biases, panels, model.norm.weight,
            model.lm_head.packed, kv, torch.tensor([16, 17]), tables, lens, num_heads, 2, 1e-6,
        )  # fmt: skip

    with pytest.raises(
        RuntimeError, match=r"decode_forward: weights must hold 6 tensors per layer"
    ):
        call(weights=weights[:-1])
    with pytest.raises(RuntimeError, match=r"decode_forward: biases must hold 4 entries per layer"):
        call(biases=biases[:-1])
    with pytest.raises(RuntimeError, match=r"decode_forward: panels must hold 4 entries per layer"):
        call(panels=panels[:-1])
    with pytest.raises(RuntimeError, match=r"decode_forward: kv must be a contiguous"):
        call(kv=cache.data[0])
    with pytest.raises(RuntimeError, match=r"decode_forward: num_heads must be a multiple"):
        call(num_heads=3)
