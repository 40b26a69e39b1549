"""Sampling on vLLM through PDD's sampler (``pdd.engine_vllm.logits``): seeded, penalized.

vLLM has no "append tokens": an extension aborts the request's incarnation and re-adds prompt +
outputs as a longer prompt. With vLLM's own sampler the re-added request draws from a fresh
generator and stops counting the re-added outputs in its presence/frequency penalties; with
PDD's, every token depends only on (seed, absolute position, prompt, all outputs so far). So a
request extended mid-way — the first token handed over (P-MD), a relay's one-shot batch, an
append at the end of what it decoded, a catch-up that replaces from a position — must give the
tokens of the same request run alone, and our engine on the same weights must give them too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdd.core.sampling_params import SamplingParams
from pdd.engine.protocol import EngineBackend

N = 32
CASES = {
    "top_p": SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11),
    "top_k": SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.8, top_k=40, seed=12),
    "penalties": SamplingParams(
        max_tokens=N,
        ignore_eos=True,
        temperature=0.8,
        seed=13,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias=((7, 2.0), (42, -3.0)),
    ),
    "greedy_penalties": SamplingParams(
        max_tokens=N, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5
    ),
}


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 37 + i * 13 + (i * i) % 19) % 500 for i in range(n)]


def _run(eng: EngineBackend, rid: str) -> list[int]:
    tokens = []
    while eng.has_schedulable():
        tokens += [o.token_id for o in eng.step() if o.request_id == rid]
    return tokens


def _step_until(eng: EngineBackend, rid: str, n: int) -> None:
    while len(eng.output_token_ids(rid)) < n:
        eng.step()


def _handed_over(eng: EngineBackend, rid: str, prompt, sp, tokens: list[int]) -> list[int]:
    """MainDecode's admission of a handed-over request: paused, ``tokens`` appended, resumed."""
    eng.add_request(rid, prompt, sp, paused=True)
    eng.append_tokens(rid, tokens, 0)
    eng.resume(rid)
    return tokens + _run(eng, rid)


@pytest.mark.parametrize("case", CASES)
def test_an_extended_request_draws_what_vllm_alone_draws(md, case):
    sp, prompt = CASES[case], _prompt(len(case), 300)  # three 128-token blocks, the last partial
    (alone,) = md.generate([prompt], sp)
    assert len(alone) == N
    # P-MD (prefill's first token) and a relay's one-shot handoff of nine tokens.
    assert _handed_over(md, f"{case}-pmd", prompt, sp, alone[:1]) == alone
    assert _handed_over(md, f"{case}-1shot", prompt, sp, alone[:9]) == alone
    # Running, then extended past what it decoded: a re-add with the outputs as prompt.
    rid = f"{case}-ext"
    md.add_request(rid, prompt, sp)
    _step_until(md, rid, 5)
    have = md.output_token_ids(rid)
    assert have == alone[: len(have)]
    assert md.append_tokens(rid, alone[len(have) : len(have) + 6]) is False
    assert have + alone[len(have) : len(have) + 6] + _run(md, rid) == alone
    # Catch-up: decoded ahead, then the relay's tokens from position 4 on, past its own.
    rid = f"{case}-catch-up"
    md.add_request(rid, prompt, sp)
    _step_until(md, rid, 10)
    ahead = md.output_token_ids(rid)
    assert ahead == alone[: len(ahead)]
    assert md.append_tokens(rid, alone[4 : len(ahead) + 5], 4) is False  # they agree: kept
    assert ahead + alone[len(ahead) : len(ahead) + 5] + _run(md, rid) == alone


def test_a_catch_up_that_replaces_tokens_continues_from_the_relays(md, ours):
    """What MainDecode decoded past a differing token is dropped; the rest is what the request
    with the relay's tokens as its outputs draws — on vLLM one-shot, and on our engine."""
    sp, prompt = CASES["penalties"], _prompt(40, 280)
    md.add_request("rep", prompt, sp)
    _step_until(md, "rep", 12)
    ahead = md.output_token_ids("rep")
    decided = [*ahead[:6], next(t for t in range(3, 500) if t != ahead[6])]
    assert md.append_tokens("rep", decided[4:], 4) is True
    got = decided + _run(md, "rep")
    assert got == _handed_over(md, "rep-1shot", prompt, sp, decided)
    assert got == _handed_over(ours, "rep-ours", prompt, sp, decided)


def test_an_unseeded_request_keeps_one_seed_across_incarnations(md):
    sp, prompt = replace(CASES["top_p"], seed=None), _prompt(41, 260)
    md.add_request("noseed", prompt, sp)
    seed = md._requests["noseed"].sampling.seed  # drawn once, at admission
    assert seed is not None
    _step_until(md, "noseed", 6)
    md.pause("noseed")  # the incarnation goes
    md.resume("noseed")  # a new one, prompt + outputs as its prompt
    got = md.output_token_ids("noseed") + _run(md, "noseed")
    assert got == md.generate([prompt], replace(sp, seed=seed))[0]


@pytest.mark.parametrize("case", CASES)
def test_vllm_with_pdds_sampler_equals_our_engine(md, ours, case):
    """The same seeded request on both engines, same weights (float32, peaked logits).

    NOTE: the two engines' logits differ in the last float bits, so a divergence would be
    acceptable only at a near-tie (DESIGN §4: a uniform within ~1e-3 of a bucket's edge, a
    top-2 margin below ~1e-3 when greedy); these prompts and seeds have none."""
    sp, prompt = CASES[case], _prompt(50 + len(case), 290)
    assert md.generate([prompt], sp) == ours.generate([prompt], sp)


def test_logprobs_stay_the_models_own(md, ours):
    """PDD's processor leaves one finite logit per row, yet the logprobs are the raw model's."""
    sp, prompt = replace(CASES["penalties"], logprobs=3), _prompt(60, 270)
    md.add_request("lp", prompt, sp)
    ours.add_request("lp", prompt, sp)
    theirs = [o for o in _outputs(md, "lp")]
    mine = [o for o in _outputs(ours, "lp")]
    assert [o.token_id for o in theirs] == [o.token_id for o in mine]
    for a, b in zip(theirs, mine):
        assert a.logprob.logprob == pytest.approx(b.logprob.logprob, abs=1e-3)
        assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
        assert all(
            lp == pytest.approx(lq, abs=1e-3)
            for (_, lp), (_, lq) in zip(a.logprob.top, b.logprob.top)
        )
    assert any(o.logprob.logprob < -1e-3 for o in theirs)  # sampled, not forced to 0.0


def _outputs(eng: EngineBackend, rid: str) -> list:
    outs = []
    while eng.has_schedulable():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs
