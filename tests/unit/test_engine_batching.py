"""Continuous batching, chunked prefill and the radix prefix cache against the transformers oracle."""

from __future__ import annotations

import random

import pytest

from pdd.core.block_hash import chain_hashes
from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

CKPT = tiny_model(11, num_layers=2, num_heads=4, num_kv_heads=2)


def ragged_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_continuous(
    engine: Engine, arrivals: dict[int, list[tuple[str, list[int], int]]]
) -> dict[str, list[int]]:
    """Step the engine, adding ``arrivals[step]`` requests mid-flight; collect every output stream."""
    outputs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, max_tokens in arrivals.get(step, []):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
            outputs[rid] = []
        for out in engine.step():
            assert out.position == len(outputs[out.request_id])
            outputs[out.request_id].append(out.token_id)
        step += 1
    return outputs


@pytest.mark.parametrize("budget", [2048, 7])
def test_continuous_batch_of_ragged_requests_matches_transformers(budget, llama_oracle):
    """Different prompt lengths and max_tokens, some joining mid-flight; budget 7 forces chunked prefill."""
    oracle = llama_oracle(CKPT)
    prompts = ragged_prompts(8, seed=1)
    max_tokens = [5, 17, 1, 9, 12, 3, 20, 8]
    arrivals: dict[int, list] = {}
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        arrivals.setdefault([0, 0, 0, 2, 3, 3, 7, 11][i], []).append((f"r{i}", p, m))
    engine = Engine(CKPT, EngineConfig(num_blocks=128, max_num_batched_tokens=budget))
    outputs = run_continuous(engine, arrivals)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert len(outputs[f"r{i}"]) == m
        oracle.assert_greedy_equal(p, outputs[f"r{i}"])
    engine.blocks.cache.check_integrity()


def test_chunked_prefill_after_a_cached_prefix(llama_oracle):
    """A long prompt whose first blocks are cached is prefilled in 5-token chunks (offset causal mask)."""
    oracle = llama_oracle(CKPT)
    rng = random.Random(2)
    prefix = [rng.randrange(256) for _ in range(40)]
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8, max_num_batched_tokens=5))
    first = prefix + [1, 2, 3]
    second = prefix + [rng.randrange(256) for _ in range(23)]
    (out1,) = engine.generate([first], SamplingParams(max_tokens=6))
    assert engine.prefix_match_len(second) == 40
    engine.add_request("second", second, SamplingParams(max_tokens=10))
    assert engine.num_cached_tokens("second") == 40
    out2 = []
    while engine.has_unfinished():
        out2 += [o.token_id for o in engine.step()]
    oracle.assert_greedy_equal(first, out1)
    oracle.assert_greedy_equal(second, out2)


def test_concurrent_requests_share_a_prefix_as_soon_as_it_is_computed(llama_oracle):
    oracle = llama_oracle(CKPT)
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(32)]
    a, b = prefix + [7, 7, 7], prefix + [9]
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=16))
    engine.add_request("a", a, SamplingParams(max_tokens=30))
    outs = {"a": [o.token_id for o in engine.step()], "b": []}
    # a's prompt is computed and its two full blocks went into the cache at once
    engine.add_request("b", b, SamplingParams(max_tokens=6))
    assert engine.num_cached_tokens("b") == 32
    assert engine.block_table("b")[:2] == engine.block_table("a")[:2]  # the same physical blocks
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o.token_id)
    oracle.assert_greedy_equal(a, outs["a"])
    oracle.assert_greedy_equal(b, outs["b"])
    engine.blocks.cache.check_integrity()


def test_batched_equals_single_request_runs(llama_oracle):
    """32 requests decoding together give each request's single-run tokens (near-ties excepted)."""
    oracle = llama_oracle(CKPT)
    prompts = ragged_prompts(32, seed=4, hi=30)
    batched = Engine(CKPT, EngineConfig(num_blocks=256)).generate(
        prompts, SamplingParams(max_tokens=10)
    )
    single = Engine(CKPT, EngineConfig(num_blocks=256))
    for p, got in zip(prompts, batched):
        (ref,) = single.generate([p], SamplingParams(max_tokens=10))
        oracle.assert_greedy_equal(p, got, reference=ref)


def test_cache_events_name_blocks_by_chained_hash():
    events = []
    engine = Engine(CKPT, EngineConfig(num_blocks=8, block_size=4), on_cache_event=events.append)
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks in the prompt
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6))
    stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
    # prompt blocks while running, then the 16 computed tokens (11 + 5 outputs) at the finish
    assert stored == chain_hashes(prompt + out[:5], 4)
    assert all(e.salt == "" and e.block_size == 4 for e in events)
    engine.generate([[1] * 30], SamplingParams(max_tokens=2))  # needs every block: evicts
    evicted = [h for e in events if e.kind == "evicted" for h in e.block_hashes]
    assert set(evicted) <= set(stored) and evicted


def test_salt_isolates_the_prefix_cache():
    engine = Engine(CKPT, EngineConfig(num_blocks=32, block_size=4))
    prompt = list(range(30, 50))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1), salt="tenant-a")
    engine.step()
    assert engine.prefix_match_len(prompt, "tenant-a") == 20
    assert engine.prefix_match_len(prompt, "tenant-b") == 0
    engine.add_request("b", prompt, SamplingParams(max_tokens=1), salt="tenant-b")
    assert engine.num_cached_tokens("b") == 0
    engine.add_request("a2", prompt, SamplingParams(max_tokens=1), salt="tenant-a")
    assert engine.num_cached_tokens("a2") == 16  # all but the last token, in whole blocks


def test_prefix_caching_can_be_disabled(llama_oracle):
    engine = Engine(CKPT, EngineConfig(num_blocks=32, enable_prefix_caching=False))
    prompts = [list(range(50, 90))] * 2
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert engine.prefix_match_len(prompts[0]) == 0 and engine.kv_usage() == (0, 32)
    for p, o in zip(prompts, outs):
        llama_oracle(CKPT).assert_greedy_equal(p, o)
