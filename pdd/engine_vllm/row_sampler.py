"""``RowSampler``: one request's PDD sampling inside vLLM's batch, drawn as our engine draws it.

vLLM sees a PDD request as incarnations whose prompt is the PDD prompt + the outputs so far
(``engine``). For a request that samples or adjusts its logits, ``to_vllm`` puts what PDD's
sampler needs into vLLM's ``extra_args`` (``extra_args``): the parameters, the seed and the PDD
prompt's length, so the tokens past it in an incarnation's prompt count as outputs again. The
logits processor (``logits``) builds one ``RowSampler`` per such row from them and asks it for
the row's token: PDD's bias and penalties over the PDD prompt and *all* outputs, then PDD's draw
for absolute position ``len(prompt) + len(outputs)`` — ``Sequence.num_tokens`` at sampling time
in our engine. So every incarnation, and every engine, draws the same token at a position.

No vLLM here: the unit tests run it without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdd.core.sampling_params import SamplingParams
from pdd.engine import sampling

EXTRA_KEY = "pdd_sampling"  # the key of our entry in vLLM's ``SamplingParams.extra_args``

_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def needs_row_sampler(sp: SamplingParams) -> bool:
    """Whether PDD samples ``sp``'s rows (random, or logits adjusted); plain greedy stays vLLM's."""
    return not sp.greedy or sp.adjusts_logits


def extra_args(sp: SamplingParams, prompt_len: int) -> dict[str, Any]:
    """What ``RowSampler.from_request`` reads back: plain ints, floats and lists (vLLM checks
    ``extra_args`` as MessagePack-able). NOTE: the seed is taken mod 2**63, as
    ``position_uniform`` reads it; a greedy request's (unused) seed is 0."""
    args: dict[str, Any] = {name: getattr(sp, name) for name in _FIELDS}
    args["logit_bias"] = [[t, b] for t, b in sp.logit_bias]
    args["seed"] = (sp.seed or 0) & (2**63 - 1)
    args["prompt_len"] = prompt_len
    return args


@dataclass(eq=False)
class RowSampler:
    sampling: SamplingParams
    seed: int
    prompt_len: int  # the PDD prompt's length; the incarnation's prompt past it is outputs
    prompt_ids: Sequence[int]  # the incarnation's prompt: PDD prompt + outputs at its start
    output_ids: Sequence[int]  # the incarnation's outputs: vLLM's list, which grows in place
    prompt_seen: torch.Tensor | None = None  # [V] bool, for a repetition penalty; built once

    @classmethod
    def from_request(
        cls,
        extra: dict[str, Any] | None,
        prompt_ids: Sequence[int] | None,
        output_ids: Sequence[int],
    ) -> RowSampler | None:
        """The row sampler of a vLLM request, or None for one ``to_vllm`` left to vLLM."""
        args = (extra or {}).get(EXTRA_KEY)
        if args is None:
            return None
        if prompt_ids is None or not 0 < args["prompt_len"] <= len(prompt_ids):
            raise ValueError(f"{EXTRA_KEY}: prompt_len does not fit the request's prompt")
        sp = SamplingParams(
            **{name: args[name] for name in _FIELDS},
            logit_bias=tuple((t, b) for t, b in args["logit_bias"]),
        )
        return cls(sp, args["seed"], args["prompt_len"], prompt_ids, output_ids)

    @property
    def position(self) -> int:
        """The absolute position of the token sampled now."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def outputs(self) -> list[int]:
        """Every PDD output so far: those the incarnation started with, then its own."""
        return [*self.prompt_ids[self.prompt_len :], *self.output_ids]

    def token(self, logits: torch.Tensor) -> int:
        """The token PDD's sampler draws from the model's ``logits [V]`` (float32) at
        ``position`` — what ``Sampler.sample`` does for one row without a grammar."""
        rows = logits[None]  # [1, V]
        if self.sampling.adjusts_logits:
            rows = sampling.adjust_logits(
                rows, [(self.sampling, self._prompt_seen(rows.shape[-1]), self.outputs)]
            )
        return sampling.sample(rows, [self.sampling], [self.seed], [self.position])[0]

    def _prompt_seen(self, vocab: int) -> torch.Tensor | Sequence[int]:
        if self.sampling.repetition_penalty == 1.0:
            return ()
        if self.prompt_seen is None:
            self.prompt_seen = sampling.prompt_mask(self.prompt_ids[: self.prompt_len], vocab)
        return self.prompt_seen
