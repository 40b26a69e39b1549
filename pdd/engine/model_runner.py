"""``ModelRunner``: turns a scheduled batch into flat tensors, runs the model, returns logits.

Rows are laid out decode-first (one token per decoding sequence), then the
prefill chunks; only the last row of a sequence that has now computed every
known token is turned into logits (and, for a request scoring its prompt, every row of a prompt
position followed by another prompt token: ``ScoredRows``). Block tables are padded into one tensor per
group so each layer does one kernel call (or one gather and one SDPA) per group,
never a Python loop over sequences. Decode rows read the pool in place with the
paged kernel when it is enabled (``paged_decode``): they then need only their
context lengths, no mask and no gather buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.engine.attention import AttentionMetadata
from pdd.engine.block_manager import BlockManager
from pdd.engine.kv_cache import KvCache
from pdd.engine.model import LlamaModel
from pdd.engine.paged_decode import enabled as paged_kernel_enabled
from pdd.engine.rope import RotaryTable
from pdd.engine.sequence import Sequence


@dataclass(frozen=True)
class ScoredRows:
    """Logits of prompt positions ``[start, start + len(logits))`` of ``seq``: row ``i`` scores
    prompt token ``start + i + 1``."""

    seq: Sequence
    start: int
    logits: torch.Tensor  # [R, V] float32


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KvCache,
        blocks: BlockManager,
        rope: RotaryTable,
        device: torch.device,
        paged_decode_kernel: bool = True,
    ):
        self.model, self.cache, self.blocks, self.rope, self.device = (
            model,
            cache,
            blocks,
            rope,
            device,
        )
        self.block_size = blocks.block_size
        # False when not requested, not a CPU float32 pool, or the kernel failed to build
        self.paged_kernel = paged_kernel_enabled(paged_decode_kernel, device, cache.dtype)
        self.num_forwards = 0
        self._workspace = torch.empty(
            0, dtype=cache.dtype, device=device
        )  # backs the gather buffers

    @torch.inference_mode()
    def run(
        self, batch: list[tuple[Sequence, int]]
    ) -> tuple[list[Sequence], torch.Tensor, list[ScoredRows]]:
        """Forward ``batch``; returns the sequences to sample, their logits ``[S, V]`` (float32) and
        the prompt rows scored for requests that asked for prompt logprobs."""
        decode = [(s, n) for s, n in batch if n == 1]
        prefill = [(s, n) for s, n in batch if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        rows: list[int] = []
        scored: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows)
        score_rows: list[int] = []
        scratch = self.cache.scratch_slot
        for s, n in decode + prefill:
            start = s.num_computed
            ids.extend(s.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.blocks.slots(s, start, start + n, scratch))
            if start + n == s.num_tokens and s.finish_when_computed is None:
                sampled.append(s)
                rows.append(len(ids) - 1)
            if s.prompt_logprobs is not None and (end := min(start + n, s.prompt_len - 1)) > start:
                scored.append((s, start, end - start))
                score_rows.extend(range(len(ids) - n, len(ids) - n + end - start))
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decode=len(decode))
        if decode:
            self._decode_meta(meta, [s for s, _ in decode])
        if prefill:
            self._prefill_meta(meta, prefill)
        self._gather_buffers(meta)
        cos, sin = self.rope.lookup(self._tensor(positions))
        # a pure decode step samples every row, in order
        every_row = not score_rows and len(rows) == len(ids)
        logits = self.model(
            self._tensor(ids),
            cos,
            sin,
            self.cache,
            meta,
            None if every_row else self._tensor(rows + score_rows),
        )  # [S + R, V]
        self.num_forwards += 1
        out, at = [], len(rows)
        for s, start, count in scored:
            out.append(ScoredRows(s, start, logits[at : at + count]))
            at += count
        return sampled, logits[: len(rows)], out

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _gather_buffers(self, meta: AttentionMetadata) -> None:
        """Carve this step's decode and prefill gather buffers out of one reused workspace."""
        decode_gathers = (
            meta.decode_context_lens is None
        )  # the paged kernel reads the pool in place
        tables = [meta.decode_block_tables if decode_gathers else None, meta.prefill_block_tables]
        counts = [0 if t is None else t.numel() for t in tables]
        block_shape = self.cache.layer(0).shape[1:]  # [bs, 2, KV, D]
        block_numel = block_shape.numel()
        need = sum(counts) * block_numel
        if not need <= self._workspace.numel() <= 8 * need:  # grow, or give back a past peak
            self._workspace = torch.empty(need, dtype=self.cache.dtype, device=self.device)
        views = self._workspace[:need].split([c * block_numel for c in counts])
        decode, prefill = (v.view(c, *block_shape) if c else None for v, c in zip(views, counts))
        meta.decode_gather_buffer, meta.prefill_gather_buffer = decode, prefill

    def _tables(self, seqs: list[Sequence], context: list[int]) -> tuple[torch.Tensor, int]:
        """Block tables padded to the longest context → ``[B, MB]`` and ``MB * block_size``."""
        mb = -(-max(context) // self.block_size)
        rows = [s.block_table[:mb] + [0] * (mb - min(mb, len(s.block_table))) for s in seqs]
        return self._tensor(rows), mb * self.block_size

    def _decode_meta(self, meta: AttentionMetadata, seqs: list[Sequence]) -> None:
        context = [s.num_computed + 1 for s in seqs]
        meta.decode_block_tables, length = self._tables(seqs, context)
        ctx = torch.tensor(context).to(self.device)  # [B] int64
        if self.paged_kernel:
            meta.decode_context_lens = ctx
            return
        mask = torch.arange(length, device=self.device)[None, :] < ctx[:, None]  # [B, L]
        meta.decode_mask = mask[:, None, None, :]  # [B, 1, 1, L]

    def _prefill_meta(self, meta: AttentionMetadata, chunks: list[tuple[Sequence, int]]) -> None:
        seqs = [s for s, _ in chunks]
        if len(chunks) == 1 and seqs[0].num_computed == 0:
            meta.prefill_causal_only = True
            return
        lens = [n for _, n in chunks]
        starts = [s.num_computed for s in seqs]
        tq = max(lens)
        meta.prefill_block_tables, length = self._tables(
            seqs, [c + n for c, n in zip(starts, lens)]
        )
        q_pos = torch.tensor(starts)[:, None] + torch.arange(tq)[None, :]  # [Bp, Tq]
        mask = torch.arange(length)[None, None, :] <= q_pos[:, :, None]  # [Bp, Tq, L]
        # NOTE: each query row repeated for the G heads of its KV group: attention folds a group's
        # heads into the query axis (as decode does) instead of repeating K/V per head.
        g = self.model.config.num_heads // self.model.config.num_kv_heads
        meta.prefill_mask = (
            mask.repeat_interleave(g, dim=1).unsqueeze(1).to(self.device)
        )  # [Bp, 1, Tq * G, L]
        if any(n != tq for n in lens):
            pad, valid, offset = [], [], 0
            for b, n in enumerate(lens):
                pad.extend(offset + min(i, n - 1) for i in range(tq))
                valid.extend(b * tq + i for i in range(n))
                offset += n
            meta.prefill_pad_index, meta.prefill_valid_index = (
                self._tensor(pad),
                self._tensor(valid),
            )
