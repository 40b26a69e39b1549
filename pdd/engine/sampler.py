"""``Sampler``: one engine's step logits → the next token of every sequence sampled in the step.

Life of a step's logits through it (the order is part of the meaning, see ``sampling``):
the model's logits ``[S, V]`` get each row's logit bias and penalties (a new tensor, only when
some row asks for them), then each grammar row is masked to what its matcher allows next (on a
copy: logprobs stay the model's own), then one token per row is drawn — greedy, or the inverse
CDF of the uniform of ``(seed, position)`` — and, for the rows that ask, its logprob is read off
the raw logits. The pure functions live in ``sampling``; this class holds what one engine's
sampling needs across steps (the vocabulary, its grammar support, each request's prompt mask).

NOTE: matchers are only read here; the engine advances one when it appends the sampled token.
"""

from __future__ import annotations

import torch

from pdd.engine import sampling
from pdd.engine.grammar import Grammars
from pdd.engine.sampling import Logprob
from pdd.engine.sequence import Sequence


class Sampler:
    """Built once per engine; ``sample`` once per step."""

    def __init__(self, vocab_size: int, grammars: Grammars) -> None:
        self.vocab_size = vocab_size
        self.grammars = grammars

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[Logprob | None]]:
        """``logits [S, V]`` (float32, row ``i`` for ``seqs[i]``) → (token per row, its ``Logprob``
        where the request asked for logprobs, else None); ``logits`` itself is never changed."""
        raw = logits
        if any(s.sampling.adjusts_logits for s in seqs):
            logits = sampling.adjust_logits(
                logits,
                [
                    (s.sampling, self._prompt_seen(s), s.output_ids)
                    if s.sampling.adjusts_logits
                    else None
                    for s in seqs
                ],
            )
        constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            # NOTE: adjust_logits already made a new tensor; otherwise copy, as logprobs read raw
            logits = logits.clone() if logits is raw else logits
            self.grammars.mask_rows(logits, constrained)
        tokens = sampling.sample(
            logits,
            [s.sampling for s in seqs],
            [s.seed for s in seqs],
            [s.num_tokens for s in seqs],
        )
        wants = [s.sampling.logprobs for s in seqs]
        if any(k is not None for k in wants):
            return tokens, sampling.token_logprobs(raw, tokens, wants)
        return tokens, [None] * len(tokens)

    def _prompt_seen(self, seq: Sequence):
        """The prompt's token set for the repetition penalty, built once per request (not per step:
        a long prompt would cost milliseconds every step)."""
        if seq.sampling.repetition_penalty == 1.0:
            return ()
        if seq.prompt_seen is None:
            seq.prompt_seen = sampling.prompt_mask(seq.token_ids[: seq.prompt_len], self.vocab_size)
        return seq.prompt_seen
