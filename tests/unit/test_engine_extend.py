"""``append_tokens`` (extend-decode): k known tokens in one forward pass equal k decode steps."""

from __future__ import annotations

import pytest

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

CKPT = tiny_model(21, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101, 102, 103]


def drain(engine: Engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("k", [1, 10, 40])
def test_extend_k_equals_k_decode_steps(k, llama_oracle):
    oracle = llama_oracle(CKPT)
    total = k + 12
    (reference,) = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8)).generate(
        [PROMPT], SamplingParams(max_tokens=total)
    )
    oracle.assert_greedy_equal(PROMPT, reference)

    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=total))
    (first,) = engine.step()
    assert first.token_id == reference[0]
    engine.append_tokens("r", reference[1 : k + 1])
    outs = engine.step()
    assert engine.last_batch == [
        ("r", k + 1)
    ]  # the last sampled token and the k appended: one chunk
    outs += drain(engine)["r"]
    assert [o.position for o in outs] == list(range(k + 1, total))
    oracle.assert_greedy_equal(
        PROMPT, reference[: k + 1] + [o.token_id for o in outs], reference=reference
    )


def test_extend_is_one_forward_pass():
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=60))
    engine.step()
    engine.append_tokens("r", list(range(30, 80)))
    computed = engine.num_cached_tokens("r")
    (out,) = engine.step()
    assert engine.num_cached_tokens("r") == computed + 51 and out.position == 51


def test_handoff_to_a_fresh_engine_by_token_ids_only(llama_oracle):
    """The relay's tokens handed to another engine that holds only the prompt: identical continuation."""
    (reference,) = Engine(CKPT, EngineConfig(num_blocks=64)).generate(
        [PROMPT], SamplingParams(max_tokens=30)
    )
    md = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    md.add_request("r", PROMPT, SamplingParams(max_tokens=30), paused=True)
    md.append_tokens("r", reference[:17])
    md.resume("r")
    outs = drain(md)["r"]
    assert [o.position for o in outs] == list(range(17, 30))
    llama_oracle(CKPT).assert_greedy_equal(
        PROMPT, reference[:17] + [o.token_id for o in outs], reference
    )


def test_catch_up_append_keeps_agreeing_tokens_and_replaces_the_rest():
    (reference,) = Engine(CKPT, EngineConfig(num_blocks=64)).generate(
        [PROMPT], SamplingParams(max_tokens=20)
    )
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20))
    engine.step()
    engine.append_tokens("r", reference[1:5])
    engine.step()  # the engine sampled output 5 itself
    assert engine.output_token_ids("r") == reference[:6]
    assert (
        engine.append_tokens("r", reference[5:9], start=5) is False
    )  # overlaps (agrees with) output 5
    assert engine.output_token_ids("r") == reference[:9]
    # a disagreeing token from the relay wins: K/V after it is dropped and recomputed
    forced = (reference[9] + 1) % 256
    assert (
        engine.append_tokens("r", [reference[8], forced], start=8) is False
    )  # nothing of ours replaced
    assert engine.output_token_ids("r") == reference[:9] + [forced]
    assert engine.num_cached_tokens("r") <= len(PROMPT) + 9
    forced8 = (reference[8] + 1) % 256
    assert (
        engine.append_tokens("r", [reference[7], forced8], start=7) is True
    )  # our output 8 replaced
    assert engine.output_token_ids("r") == reference[:8] + [forced8]
    drain(engine)
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="start"):
        engine.append_tokens("s", [1], start=3)  # a gap: outputs 0..2 are unknown


def test_append_that_completes_the_request_builds_its_kv_without_sampling():
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8), paused=True)
    engine.append_tokens("r", [1, 2, 3, 4, 5, 6, 7, 8])
    engine.resume("r")
    (out,) = engine.step()
    assert (out.token_id, out.position, out.finished, out.finish_reason) == (
        None,
        7,
        True,
        "length",
    )
    assert not engine.holds_request("r")
    # every token, the last output included, is in the radix cache for the session's next turn
    assert engine.prefix_match_len(PROMPT + [1, 2, 3, 4, 5, 6, 7, 8]) == 20


def test_append_validation():
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, stop_token_ids=(77,)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.append_tokens("r", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.append_tokens("r", [1, 999])
    with pytest.raises(ValueError, match="stop token"):
        engine.append_tokens("r", [77, 1])
    with pytest.raises(KeyError):
        engine.append_tokens("nope", [1])
    engine.append_tokens("r", [5, 77])
    (out,) = engine.step()
    assert (out.token_id, out.finish_reason) == (None, "stop")


def test_expedited_request_gets_a_step_of_its_own_and_the_same_tokens():
    reference = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8)).generate(
        [PROMPT, PROMPT[:5]], SamplingParams(max_tokens=12)
    )
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8))
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=12))
    engine.add_request("b", PROMPT[:5], SamplingParams(max_tokens=12))
    seen: dict[str, dict[int, int]] = {"a": {}, "b": {}}

    def step() -> list:
        for o in engine.step():
            if o.token_id is not None:
                seen[o.request_id][o.position] = o.token_id
        return sorted(engine.last_batch)

    step()
    assert step() == [("a", 1), ("b", 1)]
    engine.append_tokens(
        "b", reference[1][2:6]
    )  # a handoff's final extension, stalled on MainDecode
    engine.expedite("b")
    assert step() == [("b", 5)]  # alone: its last sampled token and the 4 appended, one chunk
    assert step() == [("a", 1), ("b", 1)]  # the flag is spent after one step
    engine.pause("a")
    engine.expedite("a")  # a paused request is never scheduled, expedited or not
    assert step() == [("b", 1)]
    engine.resume("a")
    while engine.has_unfinished():
        step()
    seen["b"].update({2 + i: t for i, t in enumerate(reference[1][2:6])})
    assert [seen["a"][p] for p in range(12)] == reference[0]
    assert [seen["b"][p] for p in range(12)] == reference[1]
