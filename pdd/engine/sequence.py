"""``Sequence``: one request's tokens, KV bookkeeping and life-cycle state inside the engine.

Life of a request: ``WAITING`` (added; its prompt matched against the radix
cache, the hit locked) → ``RUNNING`` (admitted by the scheduler; gets blocks and
token budget every step until every known token is computed, then one token is
sampled per step) → ``FINISHED`` (stop token or length; its full blocks go into
the radix cache and it leaves the engine, unless ``keep_after_finish`` keeps its
KV for an export until ``release``). Preemption sends a running request back to
``WAITING`` with no KV; it is re-matched and recomputed on re-admission.
``paused`` is orthogonal: a paused request keeps its KV and is never scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdd.core.sampling_params import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + outputs (outputs include tokens appended by append_tokens)
    prompt_len: int
    sampling: SamplingParams
    seed: int  # the sampling seed actually used (drawn once when the request gave none)
    salt: str = ""
    paused: bool = False
    keep_after_finish: bool = False
    status: SeqStatus = SeqStatus.WAITING
    # NOTE: tokens [0, num_computed) have K/V in the pool at the slots of block_table.
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # NOTE: the first num_cached_blocks blocks belong to the radix cache (locked through
    # cache_handle) and are never written again; the rest belong to this sequence.
    num_cached_blocks: int = 0
    cache_handle: object | None = None
    finish_reason: str | None = None
    # set when append_tokens completes the request: finish once those tokens are computed
    finish_when_computed: str | None = None
    # the grammar's matcher (llguidance), which has consumed exactly the outputs; None without a grammar
    matcher: object | None = None
    # which tokens the prompt holds ([V] bool), for a repetition penalty; built once, on first use
    prompt_seen: object | None = None
    # sampling.prompt_logprobs: entry i is prompt token i + 1's Logprob (from position i's logits),
    # filled as the prompt is computed; None once reported with the first sampled output, or
    # when not asked for. NOTE: while set, the radix cache is not matched (``BlockManager.match``).
    prompt_logprobs: list | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed
