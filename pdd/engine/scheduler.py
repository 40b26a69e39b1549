"""Unified token-budget scheduler (vLLM v1 style): decode tokens and prefill chunks share one budget.

Every sequence knows its tokens and how many of them have K/V
(``num_computed``); a step gives each schedulable sequence
``min(pending, budget left)`` tokens. So a decode is a 1-token chunk, a long
prompt is split over steps (chunked prefill), ``append_tokens`` (extend) is a
k-token chunk, and requests join and leave between steps (continuous batching).

Order of one step:
1. running sequences, oldest first; when the pool cannot hold a sequence's
   chunk, the *newest* running sequence is preempted (its KV released, full
   blocks left in the radix cache, recomputed later) until it fits — if the
   sequence is itself the newest, it is the one preempted;
2. waiting sequences, FIFO, while the budget, ``max_num_seqs`` and the pool
   allow (admission never preempts anyone). A preempted sequence is re-matched
   against the radix cache when it is re-admitted.
Paused sequences are skipped everywhere and never preempted.
Expedited sequences (``expedite``: a client stream is stalled on them) get a
step of their own: while one is schedulable, the step holds only the expedited
ones — a batch-1 step instead of a full batch, for one step's delay of everyone
else. A sequence stops being expedited once it is scheduled; if none fits, the
schedulable ones stop being expedited and the step is an ordinary one.
"""

from __future__ import annotations

from collections import deque

from pdd.engine.block_manager import BlockManager
from pdd.engine.block_pool import PoolExhaustedError
from pdd.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, blocks: BlockManager):
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.expedited: set[Sequence] = set()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def expedite(self, seq: Sequence) -> None:
        self.expedited.add(seq)

    def remove(self, seq: Sequence) -> None:
        self.expedited.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick ``(sequence, num_tokens)`` pairs for one forward pass; allocates their blocks."""
        only_expedited = any(not s.paused for s in self.expedited)
        batch = self._schedule(only_expedited)
        if only_expedited:
            if batch:
                self.expedited.difference_update(seq for seq, _ in batch)
            else:  # NOTE: nothing expedited fits: give up on them rather than stall everyone
                self.expedited = {s for s in self.expedited if s.paused}
                batch = self._schedule(False)
        return batch

    def _schedule(self, only_expedited: bool) -> list[tuple[Sequence, int]]:
        budget, batch = self.max_num_batched_tokens, []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.paused or (only_expedited and seq not in self.expedited):
                i += 1
                continue
            start, n = self._chunk(seq, budget)
            if self._reserve(seq, start + n, index=i):
                seq.num_computed = start
                batch.append((seq, n))
                budget -= n
                i += 1
        active = sum(1 for s in self.running if not s.paused)
        for seq in list(self.waiting):
            if budget <= 0 or active >= self.max_num_seqs:
                break
            if seq.paused or (only_expedited and seq not in self.expedited):
                continue
            if seq.cache_handle is None and not seq.block_table:
                self.blocks.match(seq)  # re-admission after preemption
            start, n = self._chunk(seq, budget)
            if not self._try_ensure(seq, start + n):
                break
            seq.num_computed = start
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = SeqStatus.RUNNING
            batch.append((seq, n))
            budget -= n
            active += 1
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> tuple[int, int]:
        """Where this step's chunk of ``seq`` starts and how many tokens it has."""
        if seq.num_pending == 0:
            # NOTE: every known token has K/V (e.g. imported) but we need the last one's
            # logits: recompute it. Its K/V write is routed away from cached blocks.
            return seq.num_computed - 1, 1
        return seq.num_computed, min(seq.num_pending, budget)

    def _reserve(self, seq: Sequence, num_tokens: int, index: int) -> bool:
        """Blocks for ``num_tokens`` tokens of ``seq`` (``running[index]``), preempting newest-first.

        False if ``seq`` itself was preempted.
        """
        if self._try_ensure(seq, num_tokens):
            return True  # NOTE: the common case, kept O(1): no victim list per sequence per step
        victims = [s for s in self.running[index + 1 :] if not s.paused]
        while not self._try_ensure(seq, num_tokens):
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(victims.pop())
        return True

    def _try_ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """``ensure``; when short, first drop the cache locks that waiting sequences hold."""
        while True:
            try:
                self.blocks.ensure(seq, num_tokens)
                return True
            except PoolExhaustedError:
                if not self._unlock_waiting(exclude=seq):
                    return False

    def _unlock_waiting(self, exclude: Sequence) -> bool:
        """Release the newest waiting sequence that holds only a locked cache hit; False if none.

        NOTE: without this, hits locked by queued requests can pin the whole pool and
        nothing could run. The sequence is simply re-matched when it is admitted.
        Paused sequences and those holding blocks of their own keep what they have.
        """
        for seq in reversed(self.waiting):
            if (
                seq is not exclude
                and not seq.paused
                and seq.cache_handle is not None
                and len(seq.block_table) == seq.num_cached_blocks
            ):
                self.blocks.release(seq)
                return True
        return False
