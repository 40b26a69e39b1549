"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax.

The oracle is transformers on the same float32 weights: every prompt token after the first gets
``log_softmax(logits[p - 1])[token p]``, |Δ| < 1e-4, whether the prompt runs whole, in chunks,
beside other requests, or after its prefix was put in the radix cache by an earlier request
(the prefix is recomputed: a cached prefix has K/V but no logits).
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.engine.sampling import ranked_logprobs

CKPT = tiny_model(11, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPT = [3, 17, 99, 4, 250, 8, 61, 7, 7, 120, 33, 45, 2, 9, 18, 200, 5, 77, 31, 64, 12]
TOL = 1e-4


@pytest.fixture(scope="module")
def oracle_lsm(llama_oracle):
    """``tokens`` → transformers' log-softmax ``[T, V]`` over every position."""
    model = llama_oracle(CKPT).model

    @torch.inference_mode()
    def lsm(tokens: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return lsm


def _run(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams):
    engine.add_request(rid, prompt, sp)
    first = None
    while engine.holds_request(rid):
        for out in engine.step():
            if out.request_id == rid and first is None:
                first = out
    assert first is not None
    return first


def _assert_matches(lsm: torch.Tensor, prompt: list[int], lps, k: int) -> None:
    assert lps is not None and len(lps) == len(prompt) - 1
    for p, lp in enumerate(lps, start=1):
        row = lsm[p - 1]
        assert abs(lp.logprob - float(row[prompt[p]])) < TOL, f"prompt token {p}"
        assert lp.rank == int((row > row[prompt[p]]).sum()) + 1
        assert len(lp.top) == k
        want = row.topk(k)
        for (tid, v), wv in zip(lp.top, want.values.tolist()):
            assert abs(v - wv) < TOL and abs(v - float(row[tid])) < TOL


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(num_blocks=64, block_size=4),
        EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=5),  # chunked prefill
    ],
    ids=["whole", "chunked"],
)
def test_prompt_logprobs_equal_transformers(config, oracle_lsm):
    engine = Engine(CKPT, config)
    first = _run(engine, "r", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2))
    _assert_matches(oracle_lsm(PROMPT), PROMPT, first.prompt_logprobs, 2)
    assert first.position == 0


def test_a_cached_prefix_is_still_scored(oracle_lsm):
    """An earlier request leaves the prompt's blocks in the radix cache; the scoring request
    recomputes them (and still gets the same greedy continuation as the cached path)."""
    engine = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    (plain,) = engine.generate([PROMPT + [1]], SamplingParams(max_tokens=4))
    assert engine.prefix_match_len(PROMPT) >= 16  # the prefix is cached
    sp = SamplingParams(max_tokens=4, prompt_logprobs=0)
    engine.add_request("scored", PROMPT + [1], sp)
    assert engine.num_cached_tokens("scored") == 0  # NOTE: the hit is not taken
    outs, first = [], None
    while engine.holds_request("scored"):
        for out in engine.step():
            first = first or out
            outs.append(out.token_id)
    _assert_matches(oracle_lsm(PROMPT + [1]), PROMPT + [1], first.prompt_logprobs, 0)
    assert outs == plain
    # the scored prompt's blocks are shared again once reported: a later request hits them
    engine.add_request("after", PROMPT + [1], SamplingParams(max_tokens=1))
    assert engine.num_cached_tokens("after") >= 16


def test_batched_with_other_requests_and_only_on_the_first_output(oracle_lsm):
    engine = Engine(CKPT, EngineConfig(num_blocks=128, block_size=4))
    other = list(range(30, 50))
    engine.add_request("plain", other, SamplingParams(max_tokens=5))
    engine.add_request("scored", PROMPT, SamplingParams(max_tokens=5, prompt_logprobs=1))
    engine.add_request("short", [42], SamplingParams(max_tokens=2, prompt_logprobs=1))
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    _assert_matches(oracle_lsm(PROMPT), PROMPT, got["scored"][0].prompt_logprobs, 1)
    assert all(o.prompt_logprobs is None for o in got["scored"][1:])
    assert all(o.prompt_logprobs is None for o in got["plain"])
    assert got["short"][0].prompt_logprobs == ()  # one prompt token: nothing to score


def test_imported_kv_reports_no_prompt_logprobs():
    """An engine that did not compute the prompt (its K/V imported) has no logits for it."""
    source = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    source.add_request("r", PROMPT, SamplingParams(max_tokens=1), keep_after_finish=True)
    while source.step() == []:
        pass
    payload = source.export_kv("r", 0, len(PROMPT))
    target = Engine(CKPT, EngineConfig(num_blocks=64, block_size=4))
    target.add_request("r", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0), paused=True)
    target.import_kv("r", payload)
    target.resume("r")
    first = next(o for o in target.step() if o.request_id == "r")
    assert first.token_id is not None and first.prompt_logprobs is None


def test_ranked_logprobs_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0], [5.0, 1.0, 1.0, 0.0]])
    a, b = ranked_logprobs(logits, [2, 0], 2)
    lsm = torch.log_softmax(logits, dim=-1)
    assert a.rank == 3 and b.rank == 1
    assert a.logprob == pytest.approx(float(lsm[0, 2]))
    assert [t for t, _ in a.top] == [3, 1] and [t for t, _ in b.top][0] == 0
    assert ranked_logprobs(logits[:0], [], 3) == []


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
