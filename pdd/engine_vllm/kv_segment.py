"""``KvSegment``: one request's KV in a named POSIX shared-memory segment (``/dev/shm/<name>``).

What lets vLLM's workers in other processes (tensor parallelism) reach the KV the engine holds:
the engine process creates a segment per request and direction (a prefill's saves, a
MainDecode's imports), names it in each step's connector metadata (``SegmentRef``), and every
rank's worker maps it by that name for the step, writes or reads its own head slice, and lets
go. Memory: ``[ranks]`` int64 progress counters (64-byte aligned), then the KV in the canonical
layout ``[L, 2, tokens, H, D]`` with every head.

Lifetimes: the creator (``create``) owns the name — it is registered with Python's resource
tracker (unlinked should this process die without ``unlink``) and the whole size is allocated at
once (``posix_fallocate``: a full ``/dev/shm`` fails here, not with SIGBUS mid-copy); a worker
(``attach``) only maps it and never creates one: a name already unlinked (request released
meanwhile) gives None. ``unlink`` removes the name at once; the memory goes with the last view.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

SHM_DIR = "/dev/shm"
_HEADER_ALIGN = 64


@dataclass(frozen=True)
class KvSpec:
    """What one token of one store's segments holds: ``[L, 2, H, D]`` of ``dtype``."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.layers, self.heads, self.head_dim) < 1:
            raise ValueError(f"KV spec dimensions must be positive: {self}")

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, tokens, self.heads, self.head_dim)


@dataclass(frozen=True)
class SegmentRef:
    """Where a worker finds a request's KV: segment ``name`` holds positions
    ``[first, first + tokens)`` after ``ranks`` progress counters."""

    name: str
    first: int
    tokens: int
    ranks: int


def _header_bytes(ranks: int) -> int:
    return -(-ranks * 8 // _HEADER_ALIGN) * _HEADER_ALIGN


def segment_bytes(spec: KvSpec, tokens: int, ranks: int) -> int:
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    n = spec.layers * 2 * tokens * spec.heads * spec.head_dim
    return max(_header_bytes(ranks) + n * itemsize, 1)


def _view(mapping: mmap.mmap, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)


class KvSegment:
    def __init__(self, ref: SegmentRef, spec: KvSpec, mapping: mmap.mmap) -> None:
        self.ref, self.spec = ref, spec
        header = _header_bytes(ref.ranks)
        n = spec.layers * 2 * ref.tokens * spec.heads * spec.head_dim
        # NOTE: the tensors keep ``mapping`` alive; it is unmapped with the last of them.
        self.progress = _view(mapping, torch.int64, ref.ranks, 0)  # [ranks]
        self.kv = _view(mapping, spec.dtype, n, header).view(spec.shape(ref.tokens))
        self._tracked: shared_memory.SharedMemory | None = None

    @classmethod
    def create(cls, ref: SegmentRef, spec: KvSpec) -> KvSegment:
        size = segment_bytes(spec, ref.tokens, ref.ranks)
        tracked = shared_memory.SharedMemory(name=ref.name, create=True, size=size)
        try:
            fd = os.open(os.path.join(SHM_DIR, ref.name), os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except BaseException:
            tracked.close()
            tracked.unlink()
            raise
        tracked.close()  # NOTE: its own mapping; ours above is the one the tensors view
        segment = cls(ref, spec, mapping)
        segment._tracked = tracked
        return segment

    @classmethod
    def attach(cls, ref: SegmentRef, spec: KvSpec) -> KvSegment | None:
        """Map an existing segment; None when it is gone (its request was released)."""
        size = segment_bytes(spec, ref.tokens, ref.ranks)
        try:
            fd = os.open(os.path.join(SHM_DIR, ref.name), os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"shared-memory segment {ref.name} is smaller than {size} bytes")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(ref, spec, mapping)

    def unlink(self) -> None:
        """Remove the name (creator only); views already taken stay valid."""
        if self._tracked is not None:
            tracked, self._tracked = self._tracked, None
            try:
                tracked.unlink()
            except FileNotFoundError:
                pass
