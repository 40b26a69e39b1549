"""``SamplingParams``: what a request asks of the sampler (``pdd.engine.sampler``, over the
pure functions of ``pdd.engine.sampling``).

NOTE: no torch here: the gateway and kvstore convert sampling parameters and
must not load torch for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.core.errors import InvalidArgumentError

PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| at most this (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # |a logit bias| at most this (OpenAI's range)
MAX_LOGPROBS = 20  # most likely tokens reported per output token at most (vLLM's default cap)


@dataclass(frozen=True)
class Logprob:
    """An output token's log-probability under the model — its raw logits, before bias, penalties and
    temperature (vLLM's default) — and the ``logprobs`` most likely tokens' as (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # The token's rank in its distribution (1 = the most likely); None where not computed (it is
    # for prompt tokens, as vLLM's ``prompt_logprobs`` report it).
    rank: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None  # None with temperature > 0: the engine picks one per request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties, vLLM's meaning: presence/frequency subtract from the logit of every token already in
    # the output (once / once per occurrence); repetition divides a positive logit (multiplies a
    # negative one) of every token in the prompt or the output. 0, 0, 1 → off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits before the penalties (OpenAI's logit_bias), by id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no log-probabilities; k: each output token's, plus the k most likely tokens' (0..MAX_LOGPROBS)
    logprobs: int | None = None
    # Structured output: an llguidance grammar (JSON text, see ``grammar``) the output must follow
    grammar: str | None = None
    # None: no prompt scoring; k: every prompt token's logprob after the first (vLLM's
    # prompt_logprobs, OpenAI's echo), plus the k most likely tokens' at each (0..MAX_LOGPROBS).
    # NOTE: the stage that computes the prompt computes all of it (no prefix-cache hit): a cached
    # prefix has K/V but no logits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        """NOTE: the one place these rules live; the wire and HTTP converters build a
        SamplingParams and only prefix the field (``sampling.top_p``) with ``field_prefix``."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(
                "max_tokens", f"must be an int >= 1, got {self.max_tokens!r}"
            )
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # rejects NaN too
            raise InvalidArgumentError(
                "temperature", f"must be a finite number >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidArgumentError("seed", f"must be an int or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in stops):
            raise InvalidArgumentError(
                "stop_token_ids", f"must be non-negative ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", stops)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:  # also rejects NaN
                raise InvalidArgumentError(
                    name, f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {v}"
                )
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidArgumentError(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidArgumentError(
                "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidArgumentError(
                "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise InvalidArgumentError(
                "grammar", f"must be a non-empty string, got {self.grammar!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change the model's logits first (bias, penalties)."""
        return self.penalized or bool(self.logit_bias)


def _checked_bias(
    bias: tuple[tuple[int, float], ...] | dict[int, float],
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, each checked (``logit_bias[<id>]``)."""
    pairs = tuple(
        sorted((t, float(b)) for t, b in (bias.items() if isinstance(bias, dict) else bias))
    )
    for t, b in pairs:
        if not isinstance(t, int) or t < 0:
            raise InvalidArgumentError(
                "logit_bias", f"token ids must be non-negative ints, got {t!r}"
            )
        if not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:  # also rejects NaN
            raise InvalidArgumentError(
                f"logit_bias[{t}]",
                f"must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {b}",
            )
    if len({t for t, _ in pairs}) != len(pairs):
        raise InvalidArgumentError("logit_bias", "a token id appears twice")
    return pairs
