"""PDD's ``SamplingParams`` → vLLM's, for one incarnation of a request in vLLM.

What holds (said here, once): every token depends only on the request's own seed, absolute
position, PDD prompt and outputs so far — handed-over ones included — exactly as on our engine,
so output is identical across stages (P-MD, P-RLD-MD one-shot and catch-up), across an
extension (an abort and re-add as a longer prompt) and across engines:
- greedy without penalties or bias is vLLM's own argmax, as before;
- everything else (temperature, top-k, top-p, seeded or not, presence/frequency/repetition
  penalties, logit bias) is sampled by PDD's sampler inside vLLM's (``logits``, ``row_sampler``):
  vLLM gets temperature 0 and no penalties or bias, plus our parameters, the seed and the PDD
  prompt's length in ``extra_args``, so the tokens re-added as prompt still count as outputs;
- a request without a seed gets one drawn once when added (``seeded``), as our engine draws one,
  so its incarnations agree (across services the gateway's seed does it);
- logprobs stay the model's own (vLLM's raw logprobs, taken before any logits processor).
What does not: structured output (``grammar``) and prompt logprobs are refused: not wired to
vLLM yet.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdd.core.sampling_params import SamplingParams
from pdd.engine_vllm.row_sampler import EXTRA_KEY, extra_args, needs_row_sampler

PROCESSOR = "pdd.engine_vllm.logits:PddLogitsProcessor"  # for vLLM's engine args
_ARGMAX = SamplingParams()  # temperature 0, no penalties, no bias: vLLM takes the argmax


def unsupported(sp: SamplingParams) -> str | None:
    """Why vLLM cannot serve ``sp`` here (None: it can)."""
    if sp.grammar is not None:
        return "grammar: structured output is not supported on the vLLM engine"
    if getattr(sp, "prompt_logprobs", None) is not None:
        return "prompt_logprobs: not supported on the vLLM engine"
    return None


def seeded(sp: SamplingParams) -> SamplingParams:
    """``sp`` with a seed drawn once if it samples at random and has none (per request)."""
    if sp.greedy or sp.seed is not None:
        return sp
    return replace(sp, seed=random.getrandbits(63))


def to_vllm(
    sp: SamplingParams,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    transfer: dict[str, Any],
    prompt_len: int,
) -> Any:
    """vLLM ``SamplingParams`` producing up to ``max_tokens`` more outputs, token deltas only;
    ``prompt_len``: the PDD prompt's length (the incarnation's prompt past it is outputs).

    NOTE: PDD decides stops: ``ignore_eos`` is honoured by listing the model's EOS ids among the
    stop ids (vLLM runs without a tokenizer, so it knows no EOS of its own)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
    extra: dict[str, Any] = {"kv_transfer_params": transfer}
    vllm_sp = sp
    if needs_row_sampler(sp):
        extra[EXTRA_KEY] = extra_args(sp, prompt_len)
        vllm_sp = _ARGMAX  # NOTE: our processor leaves the row one finite logit: PDD's token
    return VllmSamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=vllm_sp.temperature,
        top_p=vllm_sp.top_p,
        top_k=vllm_sp.top_k,
        seed=vllm_sp.seed,
        stop_token_ids=stops,
        ignore_eos=True,
        presence_penalty=vllm_sp.presence_penalty,
        frequency_penalty=vllm_sp.frequency_penalty,
        repetition_penalty=vllm_sp.repetition_penalty,
        logit_bias=dict(vllm_sp.logit_bias) or None,
        logprobs=sp.logprobs,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )
