"""``PddLogitsProcessor``: vLLM's sampler draws PDD's token for the rows PDD samples.

Loaded by vLLM from ``EngineArgs.logits_processors`` (``sampling.PROCESSOR``), one per engine,
on vLLM's V1 model runner (the one its CPU build runs; V2 has another interface and refuses this
class at start). Life of a step's logits through vLLM's sampler, for a row whose request carries
our ``extra_args`` entry (``row_sampler``): raw logprobs are taken first (vLLM's default
``raw_logprobs``: the model's own, before any processor); then this processor, which is not
argmax-invariant and so runs for greedy batches too, has the row's ``RowSampler`` draw the
token and leaves that token the row's only finite logit; vLLM was given temperature 0 and no
penalties or bias for such requests (``to_vllm``), so its greedy argmax takes exactly that
token. Rows without the entry (plain greedy) are not touched, and with none in the batch
``apply`` returns at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdd.engine_vllm.row_sampler import RowSampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class PddLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, RowSampler] = {}  # batch index → its row sampler

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token: greedy batches must run it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self._rows,
            batch_update,
            lambda params, prompt_ids, output_ids: RowSampler.from_request(
                params.extra_args, prompt_ids, output_ids
            ),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` (float32), changed in place: each of our rows keeps only its token."""
        for i, row in self._rows.items():
            if row.output_ids and row.output_ids[-1] < 0:
                # NOTE: async scheduling's placeholder: positions and penalties would be wrong.
                raise RuntimeError("PddLogitsProcessor needs vLLM without async scheduling")
            token = row.token(logits[i])
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits
