"""``KvStore``: what a ``VllmEngine`` and its ``PddConnector`` share, per PDD request.

- *imports*: KV another engine computed (prefill's, over PDD's links), positions ``[start, end)``
  in the canonical layout with every KV head; the connector loads what vLLM's own prefix cache
  lacks of it into the paged cache when the request is scheduled;
- *saves*: a request's KV as vLLM computes it (a prefill's), copied out of the paged cache after
  each step, so ``export_kv`` serves any ``[a, b)`` after vLLM has freed the blocks.

Both live in shared memory (``kv_segment``: one segment per request and direction), because
vLLM's workers run in other processes at TP > 1. Who touches what:
- the engine side — ``VllmEngine`` and the scheduler-side connector, both in the service
  process — holds the ``KvStore`` and finds it by name in a process-wide registry (vLLM builds
  the connector itself, from a class name and a config, so the name rides in
  ``kv_connector_extra_config``);
- the workers (this process at TP 1, vLLM's worker processes at TP > 1) never look the store up:
  each step's connector metadata names the segments (``SegmentRef``), and each rank maps them
  for the step (``read_import``, ``write_save``) and reads or writes its own head slice
  (``paged_kv.head_slice``) of the all-heads tensors. A save raises the rank's progress counter
  after its copy; the store holds ``[0, n)`` with every head once every rank has saved ``n``.

Lifetimes: a request's segments are unlinked when it is dropped (released or aborted), an
import's when a newer import replaces it, and all of them on ``close`` (the engine's shutdown).
"""

from __future__ import annotations

import itertools
import os
import threading

import torch

from pdd.engine_vllm.kv_segment import KvSegment, KvSpec, SegmentRef

_REGISTRY: dict[str, KvStore] = {}
_LOCK = threading.Lock()
_NAMES = itertools.count()
PREFIX = "pdd-vllm-kv"  # segment names: f"{PREFIX}-{pid}-{store}-{segment}"


class KvStore:
    def __init__(self, spec: KvSpec, tp_size: int = 1) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.spec, self.tp_size = spec, tp_size
        self.name = f"{PREFIX}-{os.getpid()}-{next(_NAMES)}"
        self._imports: dict[str, KvSegment] = {}  # positions [ref.first, ref.first + ref.tokens)
        self._saves: dict[str, KvSegment] = {}  # positions [0, ref.tokens), per-rank progress
        self._segment_ids = itertools.count()
        self._lock = threading.Lock()

    def _create(self, first: int, tokens: int, ranks: int) -> KvSegment:
        ref = SegmentRef(f"{self.name}-{next(self._segment_ids)}", first, tokens, ranks)
        return KvSegment.create(ref, self.spec)

    # --- imports (engine writes, connector loads) -----------------------------------------------
    def put_import(self, key: str, start: int, kv: torch.Tensor) -> None:
        """Add ``kv [L, 2, n, H, D]`` of positions ``[start, start + n)``; contiguous with (or
        overlapping) what is already imported for ``key``, or replacing it when it starts at or
        before the imported start."""
        with self._lock:
            have = self._imports.get(key)
            if have is None or start <= have.ref.first:
                first, keep = start, 0
            else:
                first, keep = have.ref.first, start - have.ref.first
                if keep > have.ref.tokens:
                    end = first + have.ref.tokens
                    raise ValueError(f"import of {key} at {start} leaves a gap after {end}")
            segment = self._create(first, keep + kv.shape[2], 0)
            if keep:
                segment.kv[:, :, :keep] = have.kv[:, :, :keep]
            segment.kv[:, :, keep:] = kv.to(self.spec.dtype)
            self._imports[key] = segment
        if have is not None:
            have.unlink()

    def import_range(self, key: str) -> tuple[int, int] | None:
        with self._lock:
            have = self._imports.get(key)
        return None if have is None else (have.ref.first, have.ref.first + have.ref.tokens)

    def import_ref(self, key: str) -> SegmentRef | None:
        with self._lock:
            have = self._imports.get(key)
        return None if have is None else have.ref

    # --- saves (connector writes, engine exports) -----------------------------------------------
    def start_save(self, key: str, capacity: int) -> None:
        """Save the KV of ``key`` as it is computed, positions ``[0, capacity)``."""
        segment = self._create(0, capacity, self.tp_size)
        with self._lock:
            old, self._saves[key] = self._saves.get(key), segment
        if old is not None:
            old.unlink()

    def saving(self, key: str) -> bool:
        with self._lock:
            return key in self._saves

    def save_ref(self, key: str) -> SegmentRef | None:
        with self._lock:
            saved = self._saves.get(key)
        return None if saved is None else saved.ref

    def saved_tokens(self, key: str) -> int:
        """Positions ``[0, n)`` saved with every head (by every rank)."""
        with self._lock:
            saved = self._saves.get(key)
        return 0 if saved is None else int(saved.progress.min())

    def saved(self, key: str, start: int, end: int) -> torch.Tensor:
        """``[L, 2, end - start, H, D]``, a view of the shared memory (valid after ``drop``)."""
        with self._lock:
            saved = self._saves[key]
        return saved.kv[:, :, start:end]

    # --- lifetimes ------------------------------------------------------------------------------
    def drop(self, key: str) -> None:
        with self._lock:
            gone = [self._imports.pop(key, None), self._saves.pop(key, None)]
        for segment in gone:
            if segment is not None:
                segment.unlink()

    def close(self) -> None:
        """Unlink every segment (the engine shuts down)."""
        with self._lock:
            gone = [*self._imports.values(), *self._saves.values()]
            self._imports.clear()
            self._saves.clear()
        for segment in gone:
            segment.unlink()


# --- worker side: what one rank does with the segments a step names -----------------------------
def read_import(
    spec: KvSpec, ref: SegmentRef, start: int, end: int, heads: slice
) -> torch.Tensor | None:
    """Imported positions ``[start, end)`` of ``heads``: ``[L, 2, end - start, h, D]`` (a view of
    the segment), or None when the request was released meanwhile."""
    if not ref.first <= start <= end <= ref.first + ref.tokens:
        raise ValueError(f"{ref.name}: [{start}, {end}) is not inside the imported range")
    segment = KvSegment.attach(ref, spec)
    if segment is None:
        return None
    return segment.kv[:, :, start - ref.first : end - ref.first, heads]


def write_save(
    spec: KvSpec, ref: SegmentRef, start: int, kv: torch.Tensor, heads: slice, rank: int
) -> None:
    """Rank ``rank``'s heads ``kv [L, 2, n, h, D]`` of positions ``[start, start + n)``."""
    segment = KvSegment.attach(ref, spec)
    if segment is None:
        return  # NOTE: released meanwhile (the request was aborted)
    end = min(start + kv.shape[2], ref.tokens)
    if end > start:
        segment.kv[:, :, start:end, heads] = kv[:, :, : end - start].to(spec.dtype)
    # NOTE: after the copy: the engine reads [0, min over ranks) once the step has returned
    segment.progress[rank] = max(int(segment.progress[rank]), end)


# --- the engine side's registry -----------------------------------------------------------------
def register(store: KvStore) -> str:
    """Make ``store`` reachable by its name (the connector's ``pdd_store`` extra config)."""
    with _LOCK:
        _REGISTRY[store.name] = store
    return store.name


def lookup(name: str) -> KvStore:
    with _LOCK:
        store = _REGISTRY.get(name)
    if store is None:
        raise LookupError(f"no PDD KV store {name!r} in this process")
    return store


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)
