"""A full KV pool: recompute-preemption keeps outputs exact; a request that can never fit is refused."""

from __future__ import annotations

import random

import pytest

from pdd.engine import (
    Engine,
    EngineConfig,
    EngineStalledError,
    KvCapacityError,
    SamplingParams,
    tiny_model,
)

CKPT = tiny_model(5, num_layers=2, num_heads=4, num_kv_heads=2)


def test_preemption_keeps_outputs_correct(llama_oracle):
    oracle = llama_oracle(CKPT)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 30))] for _ in range(6)]
    # 16 blocks of 4 = 64 token slots for 6 requests that need up to ~55 each: constant preemption
    engine = Engine(CKPT, EngineConfig(num_blocks=16, block_size=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert len(o) == 24
        oracle.assert_greedy_equal(p, o)
    engine.blocks.cache.check_integrity()
    used, total = engine.kv_usage()
    assert (
        used == engine.blocks.cache.cached_blocks and engine.blocks.cache.evictable_blocks == used
    )


def test_preemption_without_prefix_caching(llama_oracle):
    oracle = llama_oracle(CKPT)
    prompts = [list(range(i, i + 20)) for i in range(5)]
    engine = Engine(CKPT, EngineConfig(num_blocks=12, block_size=4, enable_prefix_caching=False))
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        oracle.assert_greedy_equal(p, o)
    assert engine.kv_usage() == (0, 12)


def test_a_request_that_can_never_fit_raises_the_dedicated_error():
    engine = Engine(CKPT, EngineConfig(num_blocks=4, block_size=4))
    with pytest.raises(KvCapacityError) as info:
        engine.add_request("big", list(range(10)), SamplingParams(max_tokens=8))  # 17 tokens of K/V
    assert (info.value.request_id, info.value.blocks_needed, info.value.num_blocks) == ("big", 5, 4)
    assert not engine.holds_request("big")
    engine.add_request("fits", list(range(10)), SamplingParams(max_tokens=7))  # exactly 16 tokens
    while engine.has_unfinished():
        engine.step()


def test_stall_is_reported_when_kept_requests_pin_the_pool():
    engine = Engine(CKPT, EngineConfig(num_blocks=4, block_size=4))
    engine.add_request(
        "kept", list(range(12)), SamplingParams(max_tokens=1), keep_after_finish=True
    )
    engine.step()
    assert engine.holds_request("kept")
    with pytest.raises(EngineStalledError):
        engine.generate([list(range(40, 52))], SamplingParams(max_tokens=4))
