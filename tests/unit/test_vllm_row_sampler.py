"""``RowSampler`` (what PDD's logits processor inside vLLM samples with), without vLLM.

A request on vLLM lives as incarnations whose prompt is the PDD prompt + the outputs so far; the
row sampler of every incarnation must draw exactly what our engine's ``Sampler`` draws for the
request's ``Sequence`` at each position, penalties over all outputs included. The "model" here
is a fixed pure function of the tokens so far, so both see the same logits at each position.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pdd.core.sampling_params import SamplingParams
from pdd.engine.grammar import Grammars
from pdd.engine.sampler import Sampler
from pdd.engine.sequence import Sequence
from pdd.engine_vllm.row_sampler import EXTRA_KEY, RowSampler, extra_args, needs_row_sampler
from pdd.engine_vllm.sampling import seeded

VOCAB = 64
PROMPT = [5, 9, 9, 14, 2, 33, 9, 60, 1, 5]


def _logits(tokens: list[int]) -> torch.Tensor:
    """``[V]`` float32 logits that depend on the position and the last two tokens only."""
    g = torch.Generator().manual_seed(len(tokens) * 10_007 + tokens[-1] * 101 + tokens[-2])
    return torch.randn(VOCAB, generator=g) * 2.0


def _ours(sp: SamplingParams, seed: int, n: int) -> list[int]:
    """Our engine's sampler, one token per step over the request's ``Sequence``."""
    seq = Sequence("r", list(PROMPT), len(PROMPT), sp, seed)
    sampler = Sampler(VOCAB, Grammars(None))
    for _ in range(n):
        (token,), _ = sampler.sample(_logits(seq.token_ids)[None], [seq])
        seq.token_ids.append(token)
    return seq.output_ids


def _incarnations(sp: SamplingParams, n: int, cuts: list[int]) -> list[int]:
    """The request as vLLM runs it: a new incarnation (prompt + outputs so far as its prompt, a
    fresh output list) at each output count in ``cuts``, its row sampler built from
    ``extra_args`` as vLLM hands them over."""
    outputs: list[int] = []
    row = None
    while len(outputs) < n:
        if row is None or len(outputs) in cuts:
            extra = {"kv_transfer_params": {}, EXTRA_KEY: extra_args(sp, len(PROMPT))}
            extra = json.loads(json.dumps(extra))  # plain data only
            own: list[int] = []
            row = RowSampler.from_request(extra, PROMPT + outputs, own)
        token = row.token(_logits(PROMPT + outputs))
        own.append(token)  # vLLM appends to the incarnation's own list
        outputs.append(token)
    return outputs


CASES = {
    "temperature": SamplingParams(temperature=0.8, seed=7),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=8),
    "top_k": SamplingParams(temperature=0.9, top_k=5, seed=9),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=10,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((9, 1.5), (33, -2.0)),
    ),
    "greedy_penalties": SamplingParams(presence_penalty=1.0, repetition_penalty=1.5),
}


@pytest.mark.parametrize("name", CASES)
def test_every_incarnation_draws_what_our_engine_draws(name):
    sp = CASES[name]
    n = 40
    ref = _ours(sp, sp.seed or 0, n)
    assert _incarnations(sp, n, []) == ref  # vLLM alone
    assert _incarnations(sp, n, [1]) == ref  # P-MD: the first token handed over
    assert _incarnations(sp, n, [7, 8, 20, 33]) == ref  # handoffs, catch-up rounds
    if not sp.greedy:
        other = replace(sp, seed=sp.seed + 1)
        assert _incarnations(other, n, [7]) != ref  # the seed matters (not a constant draw)


def test_penalties_count_handed_over_outputs():
    """Outputs re-added as prompt still count: without that, the penalized draw differs."""
    sp = CASES["greedy_penalties"]
    row = RowSampler.from_request({EXTRA_KEY: extra_args(sp, 3)}, [1, 2, 3, 4, 4], [5])
    assert row is not None and row.outputs == [4, 4, 5] and row.position == 6
    logits = torch.zeros(VOCAB)
    logits[4], logits[7] = 3.0, 1.5  # 4 is penalized twice over (presence, repetition)
    assert row.token(logits) == 7
    as_prompt = RowSampler.from_request({EXTRA_KEY: extra_args(sp, 5)}, [1, 2, 3, 4, 4], [5])
    assert as_prompt is not None and as_prompt.token(logits) == 4  # repetition only: 3/1.5 = 2


def test_plain_greedy_stays_vllms():
    assert not needs_row_sampler(SamplingParams())
    assert not needs_row_sampler(SamplingParams(top_p=0.5, seed=3))  # greedy: ignored
    assert needs_row_sampler(SamplingParams(temperature=0.5))
    assert needs_row_sampler(SamplingParams(logit_bias={3: 1.0}))
    assert RowSampler.from_request({"kv_transfer_params": {}}, [1, 2], []) is None
    assert RowSampler.from_request(None, [1, 2], []) is None


def test_extra_args_round_trip():
    sp = CASES["penalties"]
    row = RowSampler.from_request({EXTRA_KEY: extra_args(sp, 4)}, [1, 2, 3, 4, 5, 6], [7])
    assert row is not None
    assert (row.seed, row.prompt_len, row.outputs, row.position) == (10, 4, [5, 6, 7], 7)
    for name in ("temperature", "top_p", "top_k", "presence_penalty", "logit_bias"):
        assert getattr(row.sampling, name) == getattr(sp, name)
    big = extra_args(SamplingParams(temperature=1.0, seed=-1), 1)
    assert 0 <= big["seed"] < 2**63  # what position_uniform reads of it, and MessagePack-able


def test_a_prompt_length_beyond_the_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt_len"):
        RowSampler.from_request({EXTRA_KEY: extra_args(CASES["top_p"], 9)}, [1, 2, 3], [])


def test_a_random_request_without_seed_gets_one_once():
    sp = SamplingParams(temperature=0.7)
    a, b = seeded(sp), seeded(sp)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert seeded(a) is a  # kept: every incarnation of the request draws from it
    assert seeded(SamplingParams()).seed is None  # greedy needs none
