"""PDD's ``SamplingParams`` → vLLM's, for one incarnation of a request in vLLM.

Greedy decoding is identical across stages and engines. What is not (said here, once):
- seeded sampling: vLLM draws from a per-request generator, not from (seed, position) as our
  engine does, so a re-added request (an extension) draws differently than one that ran on;
- presence/frequency penalties count vLLM's *outputs*; tokens re-added as the prompt of an
  extension no longer count (repetition penalty covers prompt and output alike, so it holds);
- structured output (``grammar``) and prompt logprobs are refused: not wired to vLLM yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdd.core.sampling_params import SamplingParams


def unsupported(sp: SamplingParams) -> str | None:
    """Why vLLM cannot serve ``sp`` here (None: it can)."""
    if sp.grammar is not None:
        return "grammar: structured output is not supported on the vLLM engine"
    if getattr(sp, "prompt_logprobs", None) is not None:
        return "prompt_logprobs: not supported on the vLLM engine"
    return None


def to_vllm(
    sp: SamplingParams,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    transfer: dict[str, Any],
) -> Any:
    """vLLM ``SamplingParams`` producing up to ``max_tokens`` more outputs, token deltas only.

    NOTE: PDD decides stops: ``ignore_eos`` is honoured by listing the model's EOS ids among the
    stop ids (vLLM runs without a tokenizer, so it knows no EOS of its own)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
    return VllmSamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
        stop_token_ids=stops,
        ignore_eos=True,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=dict(sp.logit_bias) or None,
        logprobs=sp.logprobs,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": transfer},
    )
