"""``VllmEngine``: the engine boundary (``pdd.engine.protocol.EngineBackend``) over vLLM.

vLLM runs in this process through its engine API (``LLMEngine``, the engine core in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), prefix caching on — it is MainDecode's DRC.

A PDD request lives here as a ``_Request`` with its outputs; vLLM sees it as a sequence of
*incarnations* (vLLM requests ``<id>#<n>``), each with prompt = the PDD prompt + the outputs so
far, so that:
- paused = no incarnation (vLLM has no pause): ``add_request(paused)``, ``pause`` (which aborts the
  incarnation; its full blocks stay in vLLM's prefix cache) and ``resume`` (re-adds it);
- extend (``append_tokens``, append or replace from a position for catch-up) = abort + re-add with
  the longer prompt, served over the cached prefix in one pass: only the tail past the last full
  cached block is computed. Extended tokens that end the request (a stop, ``max_tokens``) are
  computed by a one-token incarnation whose sampled token is dropped; its end is reported as a
  ``StepOutput`` with no token, as our engine does;
- imported KV (``import_kv``) waits in the ``KvStore``; ``PddConnector`` loads what vLLM's prefix
  cache lacks of it when the incarnation is scheduled;
- tensor parallelism (``tensor_parallel_size``): vLLM's workers run in processes of their own;
  the store is in shared memory and each rank's worker loads and saves its own heads of it;
- ``keep_after_finish`` (prefill) = the connector saves the request's KV as vLLM computes it, and
  ``export_kv`` reads that copy (vLLM frees its blocks at once);
- cache events come from vLLM's KV events (``cache_events.CacheMirror``).

Positions: incarnation output j is PDD output ``base + j``, ``base`` = outputs at its start.
NOTE: not thread-safe; the engine loop's one thread calls everything (as for our engine).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.core.cache_event import CacheEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.engine.config import EngineConfig
from pdd.engine.engine import StepOutput
from pdd.engine.errors import KvCapacityError
from pdd.engine.kv_wire import KvPayload
from pdd.engine.model_config import ModelConfig, parse_dtype
from pdd.engine.token_rules import check_token_ids, is_stop
from pdd.engine_vllm import kv_store
from pdd.engine_vllm.cache_events import CacheMirror, MirrorPublisher
from pdd.engine_vllm.kv_segment import KvSpec
from pdd.engine_vllm.sampling import PROCESSOR, seeded, to_vllm, unsupported

# NOTE: vLLM's forward context and its worker-side KV connector are process-wide globals, so two
# engines in one process (a test's prefill, relay and MainDecode, each on its own engine loop
# thread) must never step at once; a service runs one engine and never waits on this.
_STEP_LOCK = threading.Lock()


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    salt: str
    keep_after_finish: bool
    paused: bool
    outputs: list[int] = field(default_factory=list)
    hit: int = 0  # prompt tokens vLLM's prefix cache held at admission
    incarnation: str | None = None  # the vLLM request running it now
    generation: int = 0
    base: int = 0  # outputs before the incarnation's first
    finish_when_computed: str | None = None  # the extension ended it: compute, then finish
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class VllmEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        on_cache_event: Callable[[CacheEvent], None] | None = None,
        *,
        tensor_parallel_size: int = 1,
    ) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        # NOTE: the engine core (scheduler, connector, event publisher) must run in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # NOTE: PDD's logits processor (``logits``) speaks the V1 model runner's interface; where
        # vLLM would pick its V2 runner (GPUs with Triton) it refuses the processor at start.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import EngineArgs
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        self.config = config = config or EngineConfig()
        model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_hf_dict(
            json.loads((model_dir / "config.json").read_text())
        )
        self.dtype = parse_dtype(config.dtype or self.model_config.torch_dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        mc = self.model_config
        spec = KvSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        self._store = kv_store.KvStore(spec, tensor_parallel_size)
        self._store_name = kv_store.register(self._store)
        args = EngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, self.max_model_len),
            enable_prefix_caching=config.enable_prefix_caching,
            kv_cache_memory_bytes=config.kv_cache_bytes,
            seed=0,
            tensor_parallel_size=tensor_parallel_size,
            kv_transfer_config=KVTransferConfig(
                kv_connector="PddConnector",
                kv_connector_module_path="pdd.engine_vllm.connector",
                kv_role="kv_both",
                kv_connector_extra_config={"pdd_store": self._store_name},
            ),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            # PDD's sampler for what is not plain greedy (``sampling``); it reads each step's
            # outputs, so vLLM schedules synchronously
            logits_processors=[PROCESSOR],
            async_scheduling=False,
        )
        try:
            self._llm = LLMEngine.from_engine_args(args)
        except BaseException:
            kv_store.unregister(self._store_name)
            raise
        self._scheduler = self._llm.engine_core.engine_core.scheduler
        cache = self._llm.vllm_config.cache_config
        self.block_size = cache.block_size
        self.num_blocks = cache.num_gpu_blocks
        self._mirror = CacheMirror(self.block_size, on_cache_event)
        # NOTE: vLLM's config names only its own publishers; ours takes the scheduler's place.
        self._scheduler.kv_event_publisher = MirrorPublisher(self._mirror)
        self._requests: dict[str, _Request] = {}
        self._by_incarnation: dict[str, _Request] = {}
        self._steps = 0
        self._generate_ids = 0
        self._shut_down = False

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        kv_store.unregister(self._store_name)
        self._llm.engine_core.shutdown()
        self._store.close()  # NOTE: after the workers: no step maps a segment any more

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        salt: str = "",
        paused: bool = False,
        keep_after_finish: bool = False,
    ) -> None:
        sampling = seeded(sampling or SamplingParams())  # NOTE: one seed for every incarnation
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if (why := unsupported(sampling)) is not None:
            raise ValueError(why)
        prompt = self._check_tokens("prompt_token_ids", prompt_token_ids)
        self._check_tokens("logit_bias", [t for t, _ in sampling.logit_bias])
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the max context of {self.max_model_len} tokens"
            )
        need = -(-(len(prompt) + sampling.max_tokens - 1) // self.block_size)
        if need > self.num_blocks:
            raise KvCapacityError(request_id, need, self.num_blocks)
        req = _Request(request_id, prompt, sampling, salt, keep_after_finish, paused)
        req.hit = self._mirror.match_len(prompt, salt)
        if keep_after_finish:  # NOTE: first: a full /dev/shm refuses the request here
            self._store.start_save(request_id, len(prompt) + 1)
        self._requests[request_id] = req
        if not paused:
            self._launch(req)

    def step(self) -> list[StepOutput]:
        if not self._llm.has_unfinished_requests():
            return []
        self._steps += 1
        outputs: list[StepOutput] = []
        with _STEP_LOCK:
            step = self._llm.step()
        for out in step:
            req = self._by_incarnation.get(out.request_id)
            if req is None or req.incarnation != out.request_id:
                continue  # NOTE: an incarnation aborted in this step (an extension replaced it)
            outputs += self._outputs(req, out)
        return outputs

    def _outputs(self, req: _Request, out: Any) -> list[StepOutput]:
        completion = out.outputs[0]
        if req.finish_when_computed is not None:
            if not out.finished:
                return []
            # NOTE: its one sampled token is not an output: the extension ended the request.
            self._end(req)
            return [
                StepOutput(
                    req.request_id, None, len(req.outputs) - 1, True, req.finish_when_computed
                )
            ]
        outputs = []
        tokens = list(completion.token_ids)
        logprobs = completion.logprobs or []
        for i, token in enumerate(tokens):
            req.outputs.append(token)
            last = out.finished and i == len(tokens) - 1
            reason = self._finish_reason(completion.finish_reason) if last else None
            logprob = (
                _logprob(token, logprobs[i], req.sampling.logprobs) if i < len(logprobs) else None
            )
            outputs.append(
                StepOutput(req.request_id, token, len(req.outputs) - 1, last, reason, logprob)
            )
        if out.finished:
            self._end(req)
        return outputs

    @staticmethod
    def _finish_reason(reason: str | None) -> str:
        return "stop" if reason == "stop" else "length"

    def _end(self, req: _Request) -> None:
        req.finished = True
        self._detach(req)
        if not req.keep_after_finish:
            self._forget(req)

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self._requests.values())

    def has_schedulable(self) -> bool:
        return self._llm.has_unfinished_requests()

    def num_computed_total(self) -> int:
        """Changes with every step that ran (vLLM reports no per-step progress of its own)."""
        return self._steps

    def generate(
        self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Add every prompt, step until all finish; the output token ids per prompt."""
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        ids = []
        for prompt, sp in zip(prompts, params):
            self._generate_ids += 1
            ids.append(f"generate-{self._generate_ids}")
            self.add_request(ids[-1], prompt, sp, keep_after_finish=True)
        while any(not self._requests[i].finished for i in ids):
            self.step()
        outputs = [list(self._requests[i].outputs) for i in ids]
        for i in ids:
            self.release(i)
        return outputs

    def append_tokens(self, request_id: str, token_ids: Seq[int], start: int | None = None) -> bool:
        """Make ``token_ids`` the outputs from ``start`` (default: the end): abort the running
        incarnation and (unless paused) re-add prompt + outputs; whether any were replaced."""
        req = self._get(request_id)
        if req.finished:
            raise ValueError(f"request {request_id!r} has finished")
        new = self._check_tokens("token_ids", token_ids)
        start = len(req.outputs) if start is None else start
        if not 0 <= start <= len(req.outputs):
            raise ValueError(f"start must be in [0, {len(req.outputs)}], got {start}")
        sp = req.sampling
        if start + len(new) > sp.max_tokens:
            raise ValueError(
                f"token_ids would make {start + len(new)} outputs, beyond max_tokens={sp.max_tokens}"
            )
        stops = [i for i, t in enumerate(new) if self._is_stop(sp, t)]
        if stops and stops[0] != len(new) - 1:
            raise ValueError("token_ids continue past a stop token")
        old = req.outputs[start:]
        agree = 0
        while agree < min(len(old), len(new)) and old[agree] == new[agree]:
            agree += 1
        if agree == len(new):
            return False  # the engine is already there (or ahead)
        self._detach(req)
        del req.outputs[start + agree :]
        req.outputs.extend(new[agree:])
        if stops or start + len(new) == sp.max_tokens:
            req.finish_when_computed = "stop" if stops else "length"
        if not req.paused:
            self._launch(req)
        return agree < len(old)

    def pause(self, request_id: str) -> None:
        req = self._get(request_id)
        req.paused = True
        self._detach(req)  # NOTE: vLLM cannot pause: the incarnation goes, its full blocks stay

    def resume(self, request_id: str) -> None:
        req = self._get(request_id)
        req.paused = False
        if not req.finished and req.incarnation is None:
            self._launch(req)

    def expedite(self, request_id: str) -> None:
        """A hint our engine honours; vLLM schedules running requests before waiting ones."""
        self._get(request_id)

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._detach(req)
        self._forget(req)
        return True

    def release(self, request_id: str) -> None:
        req = self._get(request_id)
        if not req.finished:
            raise ValueError(f"request {request_id!r} has not finished; abort it instead")
        self._forget(req)

    # ---- KV transfer ------------------------------------------------------------------------------
    def export_kv(
        self, request_id: str, start: int, end: int, dtype: str | None = None
    ) -> KvPayload:
        """KV of ``[start, end)`` as the connector saved it (``keep_after_finish`` requests)."""
        req = self._get(request_id)
        saved = self._store.saved_tokens(request_id) if self._store.saving(request_id) else 0
        if not 0 <= start <= end <= saved:
            raise ValueError(
                f"export range [{start}, {end}) outside the {saved} saved tokens of {req.request_id}"
            )
        kv = self._store.saved(request_id, start, end)  # [L, 2, n, H, D]
        return KvPayload.from_tensor(kv, start, self.block_size, dtype)

    def import_kv(self, request_id: str, payload: KvPayload) -> None:
        """Hold ``[start, start + n)`` for the connector to load when the request runs; positions
        below ``start`` must be in vLLM's prefix cache (its hit) or an earlier import."""
        req = self._get(request_id)
        d, mc = payload.descriptor, self.model_config
        theirs = (d.num_layers, d.num_kv_heads, d.head_dim)
        ours = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
        if theirs != ours:
            raise ValueError(
                f"payload (layers, kv heads, head dim) = {theirs} does not match the model's {ours}"
            )
        if req.finished:
            raise ValueError(f"request {request_id!r} has finished")
        computed = self.num_cached_tokens(request_id)
        if d.start_token > computed:
            raise ValueError(
                f"payload starts at token {d.start_token} but only {computed} tokens have K/V"
            )
        if d.start_token + d.num_tokens > len(req.tokens):
            raise ValueError(
                f"payload ends at token {d.start_token + d.num_tokens} beyond the request's "
                f"{len(req.tokens)} known tokens"
            )
        # NOTE: copied into shared memory (and the model's dtype) at once: no copy of our own
        self._store.put_import(request_id, d.start_token, payload.to_tensor())

    # ---- introspection ----------------------------------------------------------------------------
    def num_cached_tokens(self, request_id: str) -> int:
        req = self._get(request_id)
        if self._store.saving(request_id):
            return max(req.hit, self._store.saved_tokens(request_id))
        have = self._store.import_range(request_id)
        return max(req.hit, have[1] if have else 0)

    def prefix_match_len(self, token_ids: Seq[int], salt: str = "") -> int:
        return self._mirror.match_len(token_ids, salt)

    def kv_usage(self) -> tuple[int, int]:
        """(blocks held by requests or vLLM's prefix cache — at least, total blocks).

        NOTE: vLLM counts a cached block no request holds as free (evictable) while our engine
        counts it as used; without walking vLLM's free queue the larger of the two is reported."""
        pool = self._scheduler.kv_cache_manager.block_pool
        in_use = self.num_blocks - pool.get_num_free_blocks()
        return max(in_use, self._mirror.num_blocks), self.num_blocks

    def request_counts(self) -> tuple[int, int, int]:
        paused = sum(1 for r in self._requests.values() if r.paused and not r.finished)
        return len(self._scheduler.running), len(self._scheduler.waiting), paused

    def cache_snapshot(self) -> list[CacheEvent]:
        return self._mirror.snapshot()

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def output_token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).outputs)

    # ---- internals --------------------------------------------------------------------------------
    def _launch(self, req: _Request) -> None:
        """A new incarnation: prompt + outputs so far, the rest of the outputs to produce."""
        from vllm.inputs import TokensPrompt

        req.generation += 1
        name = f"{req.request_id}#{req.generation}"
        left = req.sampling.max_tokens - len(req.outputs)
        params = to_vllm(
            req.sampling,
            1 if req.finish_when_computed is not None else left,
            self.model_config.eos_token_ids,
            {"pdd_key": req.request_id, "pdd_save": req.keep_after_finish},
            len(req.prompt),
        )
        prompt = TokensPrompt(prompt_token_ids=req.tokens)
        if req.salt:
            prompt["cache_salt"] = req.salt
        self._llm.add_request(name, prompt, params)
        req.incarnation, req.base = name, len(req.outputs)
        self._by_incarnation[name] = req

    def _detach(self, req: _Request) -> None:
        """Abort the running incarnation (vLLM frees its blocks; full ones stay cached)."""
        if req.incarnation is None:
            return
        name, req.incarnation = req.incarnation, None
        self._by_incarnation.pop(name, None)
        self._llm.abort_request([name])

    def _forget(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        self._store.drop(req.request_id)

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return req

    def _check_tokens(self, name: str, token_ids: Seq[int]) -> list[int]:
        return check_token_ids(name, token_ids, self.model_config.vocab_size)

    def _is_stop(self, sp: SamplingParams, token: int) -> bool:
        return is_stop(sp, token, self.model_config.eos_token_ids)


def _logprob(token: int, entry: dict[int, Any], k: int | None) -> Logprob | None:
    """vLLM's per-position logprobs (sampled token + top k, by rank) as PDD's ``Logprob``."""
    if k is None or token not in entry:
        return None
    top = sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank,
    )
    return Logprob(entry[token].logprob, tuple((t, lp.logprob) for t, lp in top[:k]))
