"""The engine's request API as the services use it: validation, pause/resume, abort, release."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

CKPT = tiny_model(51, num_layers=1, max_position_embeddings=64)


@pytest.fixture
def engine() -> Engine:
    return Engine(CKPT, EngineConfig(num_blocks=32, block_size=4))


@pytest.mark.parametrize(
    "prompt, sp, match",
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, 256], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([1] * 60, SamplingParams(max_tokens=5), "max_tokens"),
    ],
)
def test_add_request_rejects_bad_input_naming_the_field(engine, prompt, sp, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("r", prompt, sp)
    assert not engine.holds_request("r")


def test_duplicate_and_unknown_request_ids(engine):
    engine.add_request("r", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already"):
        engine.add_request("r", [1, 2], SamplingParams())
    with pytest.raises(KeyError):
        engine.pause("nope")
    assert engine.abort("nope") is False


def test_step_outputs_positions_and_finish(engine):
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [(o.request_id, o.position, o.finished, o.finish_reason) for o in outs] == [
        ("r", 0, False, None),
        ("r", 1, False, None),
        ("r", 2, True, "length"),
    ]
    assert not engine.has_unfinished() and not engine.holds_request("r") and engine.step() == []


def test_paused_request_is_not_scheduled_but_keeps_its_kv(engine):
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=5))
    engine.add_request("b", list(range(20, 30)), SamplingParams(max_tokens=5))
    engine.step()
    engine.pause("a")
    held = engine.num_cached_tokens("a")
    for _ in range(3):
        assert {o.request_id for o in engine.step()} == {"b"}
    assert engine.num_cached_tokens("a") == held and engine.holds_request("a")
    assert engine.has_unfinished() and engine.has_schedulable()
    engine.pause("b")
    assert engine.has_unfinished() and not engine.has_schedulable() and engine.step() == []
    engine.resume("b")
    engine.resume("a")
    assert {o.request_id for o in engine.step()} == {"a", "b"}


def test_abort_frees_everything_and_keeps_full_blocks_cached(engine):
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=20))
    engine.step()
    engine.step()
    assert engine.abort("a") is True
    assert not engine.holds_request("a") and not engine.has_unfinished()
    engine.blocks.cache.check_integrity()
    used, total = engine.kv_usage()
    assert (
        used == engine.blocks.cache.evictable_blocks == 2
    )  # 11 computed tokens → 2 full blocks cached
    assert engine.prefix_match_len(list(range(10))) == 8


def test_keep_after_finish_holds_kv_until_release(engine):
    engine.add_request("p", list(range(10)), SamplingParams(max_tokens=1), keep_after_finish=True)
    (out,) = engine.step()
    assert out.finished and engine.holds_request("p") and not engine.has_unfinished()
    assert engine.num_cached_tokens("p") == 10
    payload = engine.export_kv("p", 8, 10)
    assert payload.start_token == 8 and payload.num_tokens == 2
    with pytest.raises(ValueError, match="finished"):
        engine.append_tokens("p", [1])
    engine.release("p")
    assert not engine.holds_request("p")
    assert engine.kv_usage()[0] == engine.blocks.cache.evictable_blocks  # only unlocked cache left
    engine.add_request("q", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="abort"):
        engine.release("q")


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=0),
        dict(num_blocks=0),
        dict(max_num_batched_tokens=0),
        dict(max_num_seqs=0),
        dict(dtype="float64"),
        dict(device="tpu"),
        dict(max_model_len=-1),
    ],
)
def test_engine_config_validation(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA"):
        Engine(CKPT, EngineConfig(num_blocks=8, device="cuda"))


def test_pool_sized_from_memory_budget():
    per_block = 1 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head dim * fp32
    engine = Engine(CKPT, EngineConfig(kv_cache_bytes=per_block * 10 + 5))
    assert engine.kv_usage() == (0, 10)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(CKPT, EngineConfig(kv_cache_bytes=per_block - 1))


def test_max_num_seqs_limits_running_requests():
    engine = Engine(CKPT, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=2))
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * 3, SamplingParams(max_tokens=3))
    assert {o.request_id for o in engine.step()} == {"r0", "r1"}
    outs = engine.generate([[9, 9]], SamplingParams(max_tokens=2))
    assert len(outs[0]) == 2 and not engine.has_unfinished()
