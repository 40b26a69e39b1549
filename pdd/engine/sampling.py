"""Sampling's pure functions: bias, penalties, greedy, temperature, top-k, top-p, seeded draws.

``sampler`` applies them to a step's logits in order; what a request asks is ``sampling_params``.

Reproducibility across engines and across a handoff: the random draw for the
token at absolute sequence position ``p`` is one uniform number derived from
``(seed, p)`` by a hash (``position_uniform``), then inverted through the
filtered distribution sorted by probability. It never depends on the batch, on
the step at which the token is produced or on which engine produces it, so an
engine that takes a request over after an ``append_tokens`` draws exactly what
the first one would have. Bias and penalties read only the request's own
parameters, prompt and outputs, so they too come out the same on every engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.engine import kernels

__all__ = [
    "Logprob",
    "SamplingParams",
    "adjust_logits",
    "position_uniform",
    "prompt_mask",
    "ranked_logprobs",
    "sample",
    "token_logprobs",
]


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that is a pure function of ``(seed, position)``."""
    digest = hashlib.blake2b(
        struct.pack("<qq", seed & (2**63 - 1), position), digest_size=8
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def prompt_mask(prompt: Sequence[int], vocab: int) -> torch.Tensor:
    """``[V]`` bool: which tokens occur in ``prompt`` (what the repetition penalty reads of it)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.as_tensor(list(prompt), dtype=torch.long)] = True
    return mask


def adjust_logits(
    logits: torch.Tensor,
    rows: Sequence[tuple[SamplingParams, Sequence[int] | torch.Tensor, Sequence[int]] | None],
) -> torch.Tensor:
    """``logits [S, V]`` with each row's bias and penalties applied; ``rows[i]`` = (params, prompt ids
    or their ``prompt_mask``, output ids) of row ``i``, or None for a row without any (left as it is).
    Returns a new tensor.

    Order and meaning as in vLLM: the logit bias is added first; then repetition (over prompt and
    output tokens: a positive logit is divided by it, a negative one multiplied); then frequency
    (times each token's count in the output) and presence (once per token in the output) are
    subtracted.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    for i, row in enumerate(rows):
        if row is None:
            continue
        sp, prompt, outputs = row
        x = out[i]
        if sp.logit_bias:
            ids, bias = zip(*sp.logit_bias)
            x[torch.as_tensor(ids, dtype=torch.long, device=x.device)] += torch.as_tensor(
                bias, dtype=x.dtype, device=x.device
            )
        if sp.repetition_penalty != 1.0:
            seen = (prompt if isinstance(prompt, torch.Tensor) else prompt_mask(prompt, vocab)).to(
                x.device, copy=True
            )
            if outputs:
                seen[torch.as_tensor(list(outputs), dtype=torch.long, device=x.device)] = True
            x[seen] = torch.where(
                x[seen] > 0, x[seen] / sp.repetition_penalty, x[seen] * sp.repetition_penalty
            )
        if outputs and (sp.frequency_penalty or sp.presence_penalty):
            counts = torch.bincount(
                torch.as_tensor(list(outputs), dtype=torch.long, device=x.device), minlength=vocab
            )[:vocab].to(x.dtype)
            x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """``logits [S, V]`` (float32) → one token per row; row ``i`` uses ``params[i]`` at ``positions[i]``.

    NOTE: random rows are sampled on the CPU in float64, so a CPU and a CUDA engine
    holding the same logits draw the same token.
    """
    tokens = greedy_tokens(logits)
    for i, sp in enumerate(params):
        if not sp.greedy:
            tokens[i] = _sample_row(logits[i].cpu(), sp, position_uniform(seeds[i], positions[i]))
    return tokens


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first maximum of each row of ``logits [S, V]`` (a NaN counts as the largest).

    NOTE: the compiled ``argmax_rows`` where the engine's kernels are loaded (CPU float32: ~26
    against ~145 us for [16, 32K]); else ``max(dim).indices``, the same rule, ~3x faster on CPU
    than ``argmax``.
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and kernels.loaded()
    ):
        return torch.ops.pdd.argmax_rows(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def _sample_row(logits: torch.Tensor, sp: SamplingParams, u: float) -> int:
    """Inverse-CDF draw of ``u`` through the temperature/top-k/top-p distribution ``[V]``."""
    probs = torch.softmax(logits.double() / sp.temperature, dim=-1)
    # NOTE: stable sort, so equal probabilities keep token-id order on every engine.
    probs, order = probs.sort(descending=True, stable=True)  # [V]
    keep = probs.shape[0]
    if sp.top_k:
        keep = min(keep, sp.top_k)
    cum = probs[:keep].cumsum(0)
    if sp.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(
            keep, int(torch.searchsorted(cum, torch.tensor(sp.top_p, dtype=cum.dtype)).item()) + 1
        )
    cum = cum[:keep]
    idx = int(
        torch.searchsorted(
            cum, torch.tensor(u * cum[-1].item(), dtype=cum.dtype), right=True
        ).item()
    )
    return int(order[min(idx, keep - 1)].item())


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], wants: Sequence[int | None]
) -> list[Logprob | None]:
    """Row ``i``'s ``Logprob`` of ``tokens[i]`` when ``wants[i]`` is not None (with its top ``wants[i]``),
    from the raw ``logits [S, V]``; None elsewhere."""
    rows = [i for i, k in enumerate(wants) if k is not None]
    out: list[Logprob | None] = [None] * len(wants)
    if not rows:
        return out
    lsm = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, i in enumerate(rows):
        k = wants[i]
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = lsm[j].topk(k)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out[i] = Logprob(float(lsm[j, tokens[i]]), top)
    return out


def ranked_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[Logprob]:
    """Row ``i``'s ``Logprob`` of ``tokens[i]`` with its rank (1 = the most likely) and the top
    ``k``, from the raw ``logits [R, V]``: how a prompt is scored (vLLM's ``prompt_logprobs``)."""
    if not tokens:
        return []
    lsm = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=lsm.device)
    chosen = lsm.gather(1, ids[:, None])  # [R, 1]
    ranks = ((lsm > chosen).sum(dim=-1) + 1).tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if k:
        values, top_ids = lsm.topk(k, dim=-1)  # [R, k]
        top = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return [Logprob(lp, t, rank) for lp, t, rank in zip(chosen[:, 0].tolist(), top, ranks)]
