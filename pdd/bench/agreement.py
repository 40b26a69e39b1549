"""Why greedy outputs differ across modes, when they do: near-tie or not.

Greedy decoding through P-MD, P-RLD-MD and one engine must give the same
tokens, except where two correct float paths (batched vs single, extend vs
step) order a near-tie differently (docs/engine-performance.md). For each request whose
outputs differ between modes:

  cascade   its prompts differ — an earlier turn of the session diverged and
            its output is spliced into this prompt; explained by that turn;
  near-tie  same prompt; at the first differing output the reference's
            (``transformers`` on the same weights) top-2 logit margin is
            below ``NEAR_TIE``: acceptable, and said so;
  real      same prompt and a clear margin: a correctness bug.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd.bench.trace import TraceRequest

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class Divergence:
    request_id: str
    kind: str  # "cascade" | "near-tie" | "real"
    # First differing output position and each mode's token there (not for cascades).
    position: int | None = None
    tokens: tuple[tuple[str, int], ...] = ()
    margin: float | None = None

    def describe(self) -> str:
        if self.kind == "cascade":
            return f"{self.request_id}: cascade (an earlier turn of its session diverged)"
        toks = ", ".join(f"{m} {t}" for m, t in self.tokens)
        return (
            f"{self.request_id}: {self.kind} at output {self.position} ({toks}; reference top-2 margin "
            f"{self.margin:.1e}{' < ' if self.kind == 'near-tie' else ' ≥ '}{NEAR_TIE:g})"
        )


class _Reference:
    """``transformers`` on the served model's weights, loaded on first use."""

    def __init__(self, model: str) -> None:
        self.model_spec = model
        self.model = None

    def margin(self, tokens: Sequence[int]) -> float:
        import torch

        if self.model is None:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            from pdd.serving.model_spec import load_model

            hf_logging.disable_progress_bar()

            path = load_model(self.model_spec).save_hf(tempfile.mkdtemp(prefix="pdd-reference-"))
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.inference_mode():
            top = self.model(torch.tensor([list(tokens)])).logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])


def divergences(
    trace: Sequence[TraceRequest], outputs: Mapping[str, Mapping[str, Sequence[int]]], model: str
) -> list[Divergence]:
    """Every request whose outputs differ across the modes of ``outputs`` (mode → request id → tokens)."""
    reference = _Reference(model)
    found: list[Divergence] = []
    for req in trace:
        have = {m: list(o[req.request_id]) for m, o in outputs.items() if req.request_id in o}
        if len(have) < 2 or all(v == next(iter(have.values())) for v in have.values()):
            continue
        prompts = {m: req.prompt_with_outputs(outputs[m]) for m in have}
        if any(p != next(iter(prompts.values())) for p in prompts.values()):
            found.append(Divergence(req.request_id, "cascade"))
            continue
        seqs = list(have.values())
        pos = next(
            i
            for i in range(max(map(len, seqs)))
            if len({s[i] if i < len(s) else -1 for s in seqs}) > 1
        )
        prefix = next(iter(prompts.values())) + seqs[0][:pos]
        margin = reference.margin(prefix)
        found.append(
            Divergence(
                req.request_id,
                "near-tie" if margin < NEAR_TIE else "real",
                pos,
                tuple((m, s[pos] if pos < len(s) else -1) for m, s in have.items()),
                margin,
            )
        )
    return found
