"""``KvStore``: what a ``VllmEngine`` and its ``PddConnector`` share, per PDD request.

- *imports*: KV another engine computed (prefill's, over PDD's links), positions ``[start, end)``
  in the canonical layout with every KV head; the connector loads what vLLM's own prefix cache
  lacks of it into the paged cache when the request is scheduled;
- *saves*: a request's KV as vLLM computes it (a prefill's), copied out of the paged cache after
  each step, so ``export_kv`` serves any ``[a, b)`` after vLLM has freed the blocks.

Each TP rank reads and writes its own head slice of the full-head tensors (``paged_kv.head_slice``).

NOTE: vLLM builds the connector itself (from a class name and a config), so the only way to hand
it this object is a process-wide registry keyed by a name in ``kv_connector_extra_config``. That
also means the store is reachable only by workers in this process: TP > 1 (workers in other
processes) needs a store in shared memory, which is not built (``VllmEngine`` refuses TP > 1).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

_REGISTRY: dict[str, KvStore] = {}
_LOCK = threading.Lock()
_NAMES = itertools.count()


@dataclass
class _Saved:
    kv: torch.Tensor  # [L, 2, capacity, H, D]
    # Tokens saved so far by each rank; the store holds [0, min(...)) with every head.
    upto: dict[int, int] = field(default_factory=dict)


class KvStore:
    def __init__(self, tp_size: int = 1) -> None:
        self.tp_size = tp_size
        self._imports: dict[str, tuple[int, torch.Tensor]] = {}
        self._saves: dict[str, _Saved] = {}
        self._lock = threading.Lock()

    # --- imports (engine writes, connector loads) -----------------------------------------------
    def put_import(self, key: str, start: int, kv: torch.Tensor) -> None:
        """Add ``kv [L, 2, n, H, D]`` of positions ``[start, start + n)``; contiguous with (or
        overlapping) what is already imported for ``key``, or replacing it when it starts at or
        before the imported start."""
        with self._lock:
            have = self._imports.get(key)
            if have is None or start <= have[0]:
                self._imports[key] = (start, kv)
                return
            first, old = have
            end = first + old.shape[2]
            if start > end:
                raise ValueError(f"import of {key} at {start} leaves a gap after {end}")
            self._imports[key] = (first, torch.cat([old[:, :, : start - first], kv], dim=2))

    def import_range(self, key: str) -> tuple[int, int] | None:
        with self._lock:
            have = self._imports.get(key)
        return None if have is None else (have[0], have[0] + have[1].shape[2])

    def import_slice(self, key: str, start: int, end: int) -> torch.Tensor:
        """Imported positions ``[start, end)``: ``[L, 2, end - start, H, D]``."""
        with self._lock:
            first, kv = self._imports[key]
        if start < first or end > first + kv.shape[2]:
            raise ValueError(f"{key}: [{start}, {end}) is not inside the imported range")
        return kv[:, :, start - first : end - first]

    # --- saves (connector writes, engine exports) -----------------------------------------------
    def start_save(
        self, key: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype
    ) -> None:
        """Save the KV of ``key`` as it is computed: ``shape`` = (L, 2, capacity, H, D)."""
        with self._lock:
            self._saves[key] = _Saved(torch.zeros(shape, dtype=dtype))

    def saving(self, key: str) -> bool:
        with self._lock:
            return key in self._saves

    def save(self, key: str, start: int, kv: torch.Tensor, heads: slice, rank: int = 0) -> None:
        """Rank ``rank``'s heads ``kv [L, 2, n, h, D]`` of positions ``[start, start + n)``."""
        with self._lock:
            saved = self._saves.get(key)
            if saved is None:
                return  # NOTE: released meanwhile (the request was aborted)
            end = min(start + kv.shape[2], saved.kv.shape[2])
            if end > start:
                saved.kv[:, :, start:end, heads] = kv[:, :, : end - start].to(saved.kv.dtype)
            saved.upto[rank] = max(saved.upto.get(rank, 0), end)

    def saved_tokens(self, key: str) -> int:
        """Positions ``[0, n)`` saved with every head."""
        with self._lock:
            saved = self._saves.get(key)
            if saved is None or len(saved.upto) < self.tp_size:
                return 0
            return min(saved.upto.values())

    def saved(self, key: str, start: int, end: int) -> torch.Tensor:
        with self._lock:
            saved = self._saves[key]
        return saved.kv[:, :, start:end]

    def drop(self, key: str) -> None:
        with self._lock:
            self._imports.pop(key, None)
            self._saves.pop(key, None)


def register(store: KvStore) -> str:
    """Make ``store`` reachable by name (the connector's ``pdd_store`` extra config)."""
    with _LOCK:
        name = f"pdd-kv-store-{next(_NAMES)}"
        _REGISTRY[name] = store
    return name


def lookup(name: str) -> KvStore:
    with _LOCK:
        store = _REGISTRY.get(name)
    if store is None:
        raise LookupError(f"no PDD KV store {name!r} in this process (TP > 1 is not supported)")
    return store


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)
