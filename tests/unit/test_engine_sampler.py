"""The engine's ``Sampler`` against the pure functions of ``sampling`` called directly.

One batch mixes greedy, seeded, penalised, biased and grammar-constrained rows; the sampler must
pick exactly the tokens (and logprobs) of bias+penalties → grammar mask → draw at (seed, position)
→ logprobs of the raw logits. The grammar's reference mask is written out by hand here, on a
byte-level llguidance tokenizer (no model, no download).
"""

from __future__ import annotations

import llguidance
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from pdd.engine.grammar import Grammars
from pdd.engine.sampler import Sampler
from pdd.engine.sampling import SamplingParams, adjust_logits, sample, token_logprobs
from pdd.engine.sequence import Sequence

VOCAB = 300  # the model's; wider than the grammar tokenizer's 257 (ids beyond it are padding)
EOS = 256


class _ByteTokenizer:
    """One token per byte, plus EOS: what llguidance's ``TokenizerWrapper`` reads of a tokenizer."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


TOKENIZER = LLTokenizer(TokenizerWrapper(_ByteTokenizer()))


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(None, tokenizer=TOKENIZER)


def seq(rid: str, prompt: list[int], outputs: list[int], sp: SamplingParams, seed: int = 0):
    return Sequence(rid, prompt + outputs, len(prompt), sp, seed)


def mixed_batch() -> list[Sequence]:
    seqs = [
        seq("greedy", [1, 2, 3], [], SamplingParams()),
        seq("seeded", [4, 5], [6, 7], SamplingParams(temperature=0.9, top_k=40, logprobs=3), 11),
        seq(
            "penalised",
            [8, 8, 9],
            [10, 10, 10, 12],
            SamplingParams(
                repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.5, logprobs=0
            ),
        ),
        # +100 forces token 42 whatever the draw: shows the bias reached the sampled logits
        seq("biased", [13], [], SamplingParams(temperature=1.0, logit_bias={42: 100.0}), 5),
        # the bias pushes 'z' but the grammar allows only 'b' or 'c' after 'a': the mask wins
        seq(
            "grammar",
            [14, 15],
            [ord("a")],
            SamplingParams(temperature=1.0, top_p=0.9, logit_bias={ord("z"): 100.0}, logprobs=2),
            7,
        ),
        seq("seeded_plain", [16, 17, 18], [19], SamplingParams(temperature=0.7, top_p=0.8), 99),
    ]
    matcher = LLMatcher(TOKENIZER, llguidance.grammar_from("regex", "a[bc]+"))
    assert matcher.consume_token(ord("a"))
    seqs[4].matcher = matcher
    return seqs


def reference(logits: torch.Tensor, seqs: list[Sequence]):
    """The step's tokens and logprobs from the pure functions, the grammar mask spelled out."""
    rows = [
        (s.sampling, s.token_ids[: s.prompt_len], s.output_ids)
        if s.sampling.adjusts_logits
        else None
        for s in seqs
    ]
    adjusted = adjust_logits(logits, rows)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[ord("b"), ord("c")]] = True
    adjusted[4] = adjusted[4].masked_fill(~allowed, -torch.inf)
    tokens = sample(
        adjusted, [s.sampling for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs]
    )
    return tokens, token_logprobs(logits, tokens, [s.sampling.logprobs for s in seqs])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_the_pure_functions(grammars, seed):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    before = logits.clone()
    seqs = mixed_batch()
    want_tokens, want_logprobs = reference(logits, seqs)

    tokens, logprobs = Sampler(VOCAB, grammars).sample(logits, seqs)

    assert tokens == want_tokens
    assert logprobs == want_logprobs
    assert torch.equal(logits, before)  # the model's logits are left as they were
    assert tokens[3] == 42 and tokens[4] in (ord("b"), ord("c"))
    assert [lp is not None for lp in logprobs] == [False, True, True, False, True, False]
    assert len(logprobs[1].top) == 3 and logprobs[2].top == () and len(logprobs[4].top) == 2
    # logprobs are the raw model's: the grammar row's token is read off the unmasked logits
    assert logprobs[4].logprob == pytest.approx(
        torch.log_softmax(before[4], -1)[tokens[4]].item(), abs=1e-6
    )


def test_the_prompt_mask_is_built_once_and_only_for_a_repetition_penalty(grammars):
    seqs = mixed_batch()
    sampler = Sampler(VOCAB, grammars)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    sampler.sample(logits, seqs)
    mask = seqs[2].prompt_seen
    assert isinstance(mask, torch.Tensor) and mask.shape == (VOCAB,)
    assert mask.nonzero().flatten().tolist() == [8, 9]  # the prompt's tokens, not the outputs'
    assert all(s.prompt_seen is None for i, s in enumerate(seqs) if i != 2)
    sampler.sample(logits, seqs)
    assert seqs[2].prompt_seen is mask


def test_draws_follow_seed_and_position_not_the_batch(grammars):
    sampler = Sampler(VOCAB, grammars)
    sp = SamplingParams(temperature=1.0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)).repeat(3, 1)
    seqs = [
        seq("a", [1, 2], [], sp, 21),
        seq("b", [3], [], SamplingParams()),
        seq("c", [1, 2], [], sp, 21),
    ]
    tokens, logprobs = sampler.sample(logits, seqs)
    alone, _ = sampler.sample(logits[:1], seqs[:1])
    assert tokens[0] == tokens[2] == alone[0] and logprobs == [None] * 3
    assert tokens[1] == logits[1].argmax().item()
    assert tokens == sample(logits, [sp, SamplingParams(), sp], [21, 0, 21], [2, 1, 2])


def test_a_grammar_mask_without_bias_leaves_the_models_logits_alone(grammars):
    (_, _, _, _, constrained, plain) = mixed_batch()
    constrained.sampling = SamplingParams(logprobs=0)  # greedy, nothing to adjust: only the mask
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[0, ord("z")] = 50.0  # the model's favourite, outside the grammar
    before = logits.clone()
    tokens, logprobs = Sampler(VOCAB, grammars).sample(logits, [constrained, plain])
    assert torch.equal(logits, before)
    assert tokens[0] == max((ord("b"), ord("c")), key=lambda t: before[0, t].item())
    assert logprobs[0] == token_logprobs(before, tokens, [0, None])[0]
