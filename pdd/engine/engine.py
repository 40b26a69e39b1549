"""``Engine``: the in-process LLM engine shared by prefill, relay and main-decode services.

Life of a request through it:
``add_request`` validates the prompt, matches it against the radix prefix cache
(the hit's blocks are locked and count as computed) and queues it. Each
``step`` asks the scheduler for one batch under the token budget (decode tokens
plus prefill chunks, see ``scheduler``), runs one forward pass, has the
``sampler`` pick one token for every sequence whose known tokens are now all
computed, appends them and reports them as ``StepOutput``s. A prompt's full
blocks go into the radix cache as soon as they are computed (so concurrent
requests with the same prefix share them); a finished request's full blocks do
too, then its KV is freed — or kept until ``release`` with ``keep_after_finish``
(the prefill service exports it first).

It implements ``pdd.engine.protocol.EngineBackend``, the boundary the roles use.

Disaggregation hooks: ``pause``/``resume`` (a paused request is never
scheduled, e.g. while its KV arrives), ``export_kv``/``import_kv`` (the
canonical wire format of ``kv_wire``), and ``append_tokens`` (extend: tokens
produced elsewhere become outputs and are computed in one chunk; the next token
is sampled from the last of them, exactly as k decode steps would have).

NOTE: not thread-safe; one owner thread (or one asyncio executor) calls everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdd.core.cache_event import CacheEvent
from pdd.engine.block_manager import BlockManager
from pdd.engine.checkpoint import Checkpoint, build_model, load_checkpoint
from pdd.engine.config import EngineConfig
from pdd.engine.errors import EngineStalledError, KvCapacityError
from pdd.engine.fused import enabled as fused_ops_enabled
from pdd.engine.grammar import Grammars, advance_grammar, follow_grammar
from pdd.engine.kv_cache import KvCache
from pdd.engine.kv_wire import KvPayload
from pdd.engine.model_config import ModelConfig, parse_dtype
from pdd.engine.model_runner import ModelRunner
from pdd.engine.panel_gemm import enabled as panel_gemm_enabled
from pdd.engine.rope import RotaryTable
from pdd.engine.sampler import Sampler
from pdd.engine.sampling import Logprob, SamplingParams, ranked_logprobs
from pdd.engine.scheduler import Scheduler
from pdd.engine.sequence import SeqStatus, Sequence
from pdd.engine.token_rules import check_token_ids, is_stop


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    # None only when a request finishes on tokens given by append_tokens (nothing new sampled)
    token_id: int | None
    position: int  # index in the request's outputs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None
    logprob: Logprob | None = (
        None  # when the request asked for logprobs (never for appended tokens)
    )
    # sampling.prompt_logprobs: prompt tokens 1..n-1's, on the request's first sampled output when
    # this engine computed the whole prompt (None where it did not: e.g. its K/V was imported)
    prompt_logprobs: tuple[Logprob, ...] | None = None


class Engine:
    def __init__(
        self,
        model: str | Checkpoint,
        config: EngineConfig | None = None,
        on_cache_event: Callable[[CacheEvent], None] | None = None,
    ):
        self.config = config = config or EngineConfig()
        ckpt = load_checkpoint(model)
        self.model_config, self.tokenizer = ckpt.config, ckpt.tokenizer
        self.device = config.resolve_device()
        self.dtype = parse_dtype(config.dtype or ckpt.config.torch_dtype)
        self.max_model_len = config.max_model_len or ckpt.config.max_position_embeddings
        mc = ckpt.config
        self.block_size = config.block_size
        self.num_blocks = num_blocks = self._num_blocks(config, mc, self.dtype)
        self.model = build_model(ckpt, self.dtype, self.device)
        if config.prepack_weights:
            self.model.pack_weights()
        if panel_gemm_enabled(config.panel_gemm, self.device, self.dtype):
            self.model.pack_panels()
        self.model.use_fused(fused_ops_enabled(config.fused_ops, self.device, self.dtype))
        self.kv = KvCache(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.blocks = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, on_cache_event
        )
        self.scheduler = Scheduler(config.max_num_batched_tokens, config.max_num_seqs, self.blocks)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.blocks,
            RotaryTable(mc, self.max_model_len, self.dtype, self.device),
            self.device,
            config.paged_decode_kernel,
        )
        self._seqs: dict[str, Sequence] = {}
        self._grammars = Grammars(self.tokenizer)
        self.sampler = Sampler(mc.vocab_size, self._grammars)
        self._generate_ids = 0
        self.last_batch: list[
            tuple[str, int]
        ] = []  # (request_id, tokens computed) of the last step

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        salt: str = "",
        paused: bool = False,
        keep_after_finish: bool = False,
    ) -> None:
        sampling = sampling or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        prompt = self._check_tokens("prompt_token_ids", prompt_token_ids)
        self._check_tokens("logit_bias", [t for t, _ in sampling.logit_bias])
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the max context of {self.max_model_len} tokens"
            )
        # NOTE: the last output token never gets K/V, hence the -1.
        need = self.blocks.blocks_for(len(prompt) + sampling.max_tokens - 1)
        if need > self.num_blocks:
            raise KvCapacityError(request_id, need, self.num_blocks)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        seq = Sequence(
            request_id,
            prompt,
            len(prompt),
            sampling,
            seed,
            salt,
            paused=paused,
            keep_after_finish=keep_after_finish,
        )
        if sampling.grammar is not None:
            seq.matcher = self._grammars.matcher(sampling.grammar)
        if sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * (len(prompt) - 1)
        self.blocks.match(seq)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq

    def step(self) -> list[StepOutput]:
        """One forward pass over the next batch; returns the tokens it produced."""
        batch = self.scheduler.schedule()
        self.last_batch = [(s.request_id, n) for s, n in batch]
        if not batch:
            return []
        sampled, logits, scored = self.runner.run(batch)
        for seq, n in batch:
            seq.num_computed += n
        for rows in scored:
            seq, k = rows.seq, rows.seq.sampling.prompt_logprobs
            targets = seq.token_ids[rows.start + 1 : rows.start + 1 + rows.logits.shape[0]]
            seq.prompt_logprobs[rows.start : rows.start + len(targets)] = ranked_logprobs(
                rows.logits, targets, k or 0
            )
        tokens, logprobs = self.sampler.sample(logits, sampled)
        outputs = self._append_sampled(sampled, tokens, logprobs)
        self._settle_computed(batch, outputs)
        return outputs

    def _append_sampled(
        self, sampled: list[Sequence], tokens: list[int], logprobs: list[Logprob | None]
    ) -> list[StepOutput]:
        """Append each sampled token to its sequence (and grammar) and finish those it ends."""
        outputs = []
        for seq, token, logprob in zip(sampled, tokens, logprobs):
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if seq.matcher is not None:
                reason = advance_grammar(seq.matcher, seq.request_id, token, reason)
            outputs.append(
                StepOutput(
                    seq.request_id,
                    token,
                    seq.num_outputs - 1,
                    reason is not None,
                    reason,
                    logprob,
                    self._take_prompt_logprobs(seq),
                )
            )
            if reason is not None:
                self._finish(seq, reason)
        return outputs

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple[Logprob, ...] | None:
        """The prompt's logprobs, once, if every position was computed here; then None (and the
        request may match the radix cache again, e.g. after a preemption)."""
        lps, seq.prompt_logprobs = seq.prompt_logprobs, None
        if lps is None or any(lp is None for lp in lps):
            return None
        return tuple(lps)

    def _settle_computed(
        self, batch: list[tuple[Sequence, int]], outputs: list[StepOutput]
    ) -> None:
        """After the batch's tokens got K/V: finish requests whose appended tokens are now all
        computed (adding their output to ``outputs``) and share newly full prompt blocks."""
        for seq, _ in batch:
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq.finish_when_computed is not None and seq.num_pending == 0:
                reason = seq.finish_when_computed
                outputs.append(StepOutput(seq.request_id, None, seq.num_outputs - 1, True, reason))
                self._finish(seq, reason)
            elif min(seq.num_computed, seq.prompt_len) // self.block_size > seq.num_cached_blocks:
                self.blocks.cache_blocks(
                    seq, seq.prompt_len
                )  # share the prompt while still running

    def has_unfinished(self) -> bool:
        """Any request not finished yet, paused ones included."""
        return any(s.status is not SeqStatus.FINISHED for s in self._seqs.values())

    def has_schedulable(self) -> bool:
        """Any request a ``step`` could advance (unfinished and not paused)."""
        return any(s.status is not SeqStatus.FINISHED and not s.paused for s in self._seqs.values())

    def num_computed_total(self) -> int:
        """Tokens with K/V over all held requests (a step that changes nothing here made no progress)."""
        return sum(s.num_computed for s in self._seqs.values())

    def generate(
        self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Add every prompt, step until all finish; returns the output token ids per prompt."""
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling must be one SamplingParams or one per prompt")
        seqs = []
        for prompt, sp in zip(prompts, params):
            self._generate_ids += 1
            rid = f"generate-{self._generate_ids}"
            self.add_request(rid, prompt, sp)
            seqs.append(self._seqs[rid])
        while any(s.status is not SeqStatus.FINISHED for s in seqs):
            before = [(s.num_computed, s.num_tokens) for s in seqs]
            if not self.step() and before == [(s.num_computed, s.num_tokens) for s in seqs]:
                raise EngineStalledError(
                    "no request could be scheduled: paused or kept requests pin the KV pool"
                )
        return [s.output_ids for s in seqs]

    def append_tokens(self, request_id: str, token_ids: Seq[int], start: int | None = None) -> bool:
        """Extend: make ``token_ids`` the request's outputs from index ``start`` (default: the end).

        They are computed in one chunk on the next step, which samples the token after
        them. Outputs the engine already has from ``start`` on are kept where they
        agree and replaced (their K/V dropped) from the first disagreement on; returns
        whether any were replaced.
        """
        seq = self._get(request_id)
        if seq.status is SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has finished")
        new = self._check_tokens("token_ids", token_ids)
        start = seq.num_outputs if start is None else start
        if not 0 <= start <= seq.num_outputs:
            raise ValueError(f"start must be in [0, {seq.num_outputs}], got {start}")
        sp = seq.sampling
        if start + len(new) > sp.max_tokens:
            raise ValueError(
                f"token_ids would make {start + len(new)} outputs, beyond max_tokens={sp.max_tokens}"
            )
        stops = [i for i, t in enumerate(new) if self._is_stop(sp, t)]
        if stops and stops[0] != len(new) - 1:
            raise ValueError("token_ids continue past a stop token")
        base = seq.prompt_len + start
        old = seq.token_ids[base:]
        agree = 0
        while agree < min(len(old), len(new)) and old[agree] == new[agree]:
            agree += 1
        if agree == len(new):
            return False  # the engine is already there (or ahead)
        grammar_done = False
        if seq.matcher is not None:
            grammar_done = follow_grammar(seq.matcher, seq.request_id, old[agree:], new[agree:])
        cut = base + agree
        released = self.blocks.rollback(seq, cut)
        del seq.token_ids[cut:]
        seq.token_ids.extend(new[agree:])
        if released:
            self.blocks.match(seq)
        if stops or grammar_done or start + len(new) == sp.max_tokens:
            seq.finish_when_computed = "stop" if stops or grammar_done else "length"
        return agree < len(old)

    def pause(self, request_id: str) -> None:
        self._get(request_id).paused = True

    def resume(self, request_id: str) -> None:
        self._get(request_id).paused = False

    def expedite(self, request_id: str) -> None:
        """Run this request alone in the next step (its client's stream is stalled on it)."""
        self.scheduler.expedite(self._get(request_id))

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV (its computed full blocks stay in the radix cache)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self.blocks.release(seq)
        seq.status = SeqStatus.FINISHED
        return True

    def release(self, request_id: str) -> None:
        """Free the KV a finished ``keep_after_finish`` request still holds."""
        seq = self._get(request_id)
        if seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished; abort it instead")
        del self._seqs[request_id]
        self.blocks.release(seq)

    # ---- KV transfer ----------------------------------------------------------------
    def export_kv(
        self, request_id: str, start: int, end: int, dtype: str | None = None
    ) -> KvPayload:
        """K/V of tokens ``[start, end)`` in the wire format (``dtype``: optional wire compression)."""
        seq = self._get(request_id)
        if not 0 <= start <= end <= seq.num_computed:
            raise ValueError(
                f"export range [{start}, {end}) outside the {seq.num_computed} computed tokens"
            )
        slots = torch.tensor(
            self.blocks.slots(seq, start, end), dtype=torch.long, device=self.device
        )
        return KvPayload.from_tensor(self.kv.read_tokens(slots), start, self.block_size, dtype)

    def import_kv(self, request_id: str, payload: KvPayload) -> None:
        """Write tokens ``[start, start + n)`` of the request's K/V; they then count as computed.

        Tokens below ``start`` must already have K/V (its radix-cache hit or an earlier
        import). Raises ``PoolExhaustedError`` when the pool cannot hold them even after
        evicting the unlocked radix cache; running requests are not preempted for an import.
        """
        seq = self._get(request_id)
        d, mc = payload.descriptor, self.model_config
        theirs, ours = (
            (d.num_layers, d.num_kv_heads, d.head_dim),
            (mc.num_layers, mc.num_kv_heads, mc.head_dim),
        )
        if theirs != ours:
            raise ValueError(
                f"payload (layers, kv heads, head dim) = {theirs} does not match the model's {ours}"
            )
        start, end = d.start_token, d.start_token + d.num_tokens
        if seq.status is SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has finished")
        if start > seq.num_computed:
            raise ValueError(
                f"payload starts at token {start} but only {seq.num_computed} tokens have K/V"
            )
        if end > seq.num_tokens:
            raise ValueError(
                f"payload ends at token {end} beyond the request's {seq.num_tokens} known tokens"
            )
        first = seq.num_computed  # tokens below this already have K/V (e.g. the radix-cache hit)
        if end <= first:
            return
        self.blocks.ensure(seq, end)  # NOTE: evicts from the radix cache but never preempts
        slots = torch.tensor(
            self.blocks.slots(seq, first, end), dtype=torch.long, device=self.device
        )
        kv = payload.to_tensor()[:, :, first - start :]  # [L, 2, n, KV, D]
        self.kv.write_tokens(slots, kv.to(self.device))
        seq.num_computed = end
        self.blocks.cache_blocks(seq, seq.prompt_len)

    # ---- introspection --------------------------------------------------------------
    def num_cached_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def prefix_match_len(self, token_ids: Seq[int], salt: str = "") -> int:
        return self.blocks.prefix_match_len(token_ids, salt)

    def kv_usage(self) -> tuple[int, int]:
        """(blocks in use by requests or the radix cache, total blocks)."""
        return self.blocks.num_used, self.num_blocks

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def request_counts(self) -> tuple[int, int, int]:
        """(running, waiting = queued for admission, paused) requests."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        return (
            sum(1 for s in running if not s.paused),
            sum(1 for s in waiting if not s.paused),
            sum(1 for s in running + waiting if s.paused),
        )

    def cache_snapshot(self) -> list[CacheEvent]:
        """The radix cache's content as "stored" events (kvstore rebuilds a dropped index)."""
        return self.blocks.cache.snapshot_events()

    def output_token_ids(self, request_id: str) -> list[int]:
        return self._get(request_id).output_ids

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_table)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless every block is exactly one of: free, cached, owned by one request."""
        self.blocks.cache.check_integrity()
        cached = set(self.blocks.cache._cached_ids)
        owned: list[int] = []
        for seq in self._seqs.values():
            shared = seq.block_table[: seq.num_cached_blocks]
            if not set(shared) <= cached:
                raise RuntimeError(f"{seq.request_id}: a shared block is not in the radix cache")
            if seq.num_computed > len(seq.block_table) * self.block_size:
                raise RuntimeError(
                    f"{seq.request_id}: {seq.num_computed} computed tokens exceed its blocks"
                )
            owned += seq.block_table[seq.num_cached_blocks :]
        free = {b for b in range(self.num_blocks) if self.blocks.pool.is_free(b)}
        if len(set(owned)) != len(owned) or set(owned) & (cached | free):
            raise RuntimeError("a block is owned twice, or owned and also cached or free")
        if len(owned) + len(cached) + len(free) != self.num_blocks:
            raise RuntimeError("blocks leaked: not free, not cached and not owned")

    # ---- internals ------------------------------------------------------------------
    @staticmethod
    def _num_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
        """KV blocks in the pool: ``config.num_blocks``, else as many as ``kv_cache_bytes`` holds."""
        num_blocks = config.num_blocks or config.kv_cache_bytes // KvCache.bytes_per_block(
            mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
        )
        if num_blocks <= 0:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {config.block_size} tokens"
            )
        return num_blocks

    def _get(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return seq

    def _check_tokens(self, field: str, token_ids: Seq[int]) -> list[int]:
        return check_token_ids(field, token_ids, self.model_config.vocab_size)

    def _is_stop(self, sp: SamplingParams, token: int) -> bool:
        return is_stop(sp, token, self.model_config.eos_token_ids)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if self._is_stop(seq.sampling, token):
            return "stop"
        if seq.num_outputs >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.scheduler.remove(seq)
        if seq.keep_after_finish:
            self.blocks.cache_blocks(seq)
        else:
            del self._seqs[seq.request_id]
            self.blocks.release(seq)
