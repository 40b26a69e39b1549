"""Fast-link transport for a prefill and a relay on one host: POSIX shared memory.

The relay creates segments (``multiprocessing.shared_memory``, named
``pdd-<id>``, sized to a power of two) and maps them with ``MAP_POPULATE`` at
allocation — during ``PrepareTransfer``, while prefill still computes — so no
page fault lands on the critical path. The sender maps a segment the same way
and writes each chunk with one memcpy; a producer that wants no copy at all can
write its KV straight into ``ShmWriter.view``. The relay's engine reads the
completed region in place (``ReceivedRegion.view``).

Segments are reused: a region whose transfer COMPLETED (no sender writes to it any
more) goes back to the relay's pool when released, and the sender keeps its
mappings by name (``ShmSenderBackend``). A fresh segment per transfer cost more
than the copy itself — the kernel zeroes and maps every page on both sides and
unmaps them again (64 MiB: ~40 ms against a ~10 ms memcpy) — and churned
prefill's and the relay's memory. A transfer that failed, expired or was
cancelled never returns its segment: a late sender may still write into it.

NOTE: ``close`` unlinks the name first, so the segment disappears from
``/dev/shm`` even while a consumer still holds a view of it; the memory itself
goes when the last mapping does.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from multiprocessing import resource_tracker, shared_memory

import structlog

from pdd.core.errors import UnavailableError
from pdd.kv.fast_link.region import RdmaEndpointInfo, Reservation
from pdd.kv.fast_link.state import Transport
from pdd.kv.transfer import TransferHeader

log = structlog.get_logger(__name__)
_DEV_SHM = "/dev/shm"
_MIN_SEGMENT = 64 << 10
# Bytes of idle segments the relay keeps for reuse, and of mappings a sender keeps open.
DEFAULT_POOL_BYTES = 512 << 20


def segment_name(transfer_id: str) -> str:
    return f"pdd-{transfer_id}"


def segment_exists(name: str) -> bool:
    """Whether a segment is still linked (visible under /dev/shm)."""
    return os.path.exists(os.path.join(_DEV_SHM, name))


def segment_size(nbytes: int) -> int:
    """The segment a region of ``nbytes`` lives in: a power of two (reusable across sizes)."""
    return max(_MIN_SEGMENT, 1 << (max(nbytes, 1) - 1).bit_length())


def _map_segment(name: str, nbytes: int) -> mmap.mmap | None:
    """A populated shared mapping of a segment (Linux), or None where /dev/shm or MAP_POPULATE is missing.

    MAP_POPULATE allocates and maps every page now, instead of one page fault per
    4 KiB during the copy: the difference between ~1.5 and ~5 GB/s here.
    """
    if not (os.path.isdir(_DEV_SHM) and hasattr(mmap, "MAP_POPULATE")):
        return None  # pragma: no cover - non-Linux hosts
    try:
        fd = os.open(os.path.join(_DEV_SHM, name), os.O_RDWR)
    except FileNotFoundError:
        raise UnavailableError(
            f"shared-memory segment {name} not found (not on this host, or its lease expired)"
        ) from None
    try:
        if os.fstat(fd).st_size < nbytes:
            raise UnavailableError(f"shared-memory segment {name} is smaller than {nbytes} bytes")
        return mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def _drop(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a consumer still holds a view: the mapping goes when the view does
        log.info("shm_mapping_still_viewed")


class _Segment:
    """One shared-memory segment, created and mapped (populated) by the relay."""

    def __init__(self, name: str, size: int) -> None:
        # NOTE: SharedMemory names, tracks (unlinked if this process dies) and unlinks the
        # segment; the views handed out come from our own mapping, so that closing never
        # depends on the consumer having dropped them.
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.name, self.size = self._shm.name, size
        self._map = _map_segment(self.name, size)
        if self._map is not None:
            self._shm.close()

    def view(self, nbytes: int) -> memoryview:
        return (memoryview(self._map) if self._map is not None else self._shm.buf)[:nbytes]

    def unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        if self._map is not None:
            _drop(self._map)
            self._map = None
        else:  # pragma: no cover - non-Linux hosts
            with contextlib.suppress(BufferError):
                self._shm.close()


class _SegmentPool:
    """Idle segments by size, at most ``max_bytes`` of them (the oldest unlinked first)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"pool_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._idle: list[_Segment] = []
        # NOTE: allocation runs on a worker thread (``FastLinkReceiver.prepare``), release on
        # the event loop.
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return sum(seg.size for seg in list(self._idle))

    def take(self, size: int) -> _Segment | None:
        with self._lock:
            for i, seg in enumerate(self._idle):
                if seg.size == size:
                    return self._idle.pop(i)
        return None

    def give(self, seg: _Segment) -> None:
        with self._lock:
            self._idle.append(seg)
            evicted = []
            while self._idle and self.idle_bytes > self.max_bytes:
                evicted.append(self._idle.pop(0))
        for old in evicted:
            old.unlink()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for seg in idle:
            seg.unlink()


class ShmRegion:
    rdma: RdmaEndpointInfo | None = None

    def __init__(self, segment: _Segment, nbytes: int, pool: _SegmentPool | None = None) -> None:
        self._segment: _Segment | None = segment
        self.shm_name = segment.name
        self._nbytes = nbytes
        self._pool = pool

    @property
    def view(self) -> memoryview:
        if self._segment is None:
            raise UnavailableError(f"shared-memory region {self.shm_name} is closed")
        return self._segment.view(self._nbytes)

    def close(self, reuse: bool = False) -> None:
        """Give the segment back: to the pool when ``reuse`` (its transfer completed), else
        unlinked."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        if reuse and self._pool is not None:
            self._pool.give(segment)
        else:
            segment.unlink()


class ShmReceiverBackend:
    transport = Transport.SHM

    def __init__(self, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self._pool = _SegmentPool(pool_bytes)

    @property
    def idle_bytes(self) -> int:
        """Bytes of segments kept for reuse (not held by any transfer)."""
        return self._pool.idle_bytes

    def allocate(self, transfer_id: str, nbytes: int) -> ShmRegion:
        size = segment_size(nbytes)
        segment = self._pool.take(size) or _Segment(segment_name(transfer_id), size)
        return ShmRegion(segment, nbytes, self._pool if self._pool.max_bytes else None)

    def close(self) -> None:
        """Unlink the idle segments (a relay shutting down)."""
        self._pool.clear()


class ShmWriter:
    """The sender's handle on a relay's segment: its own mapping, or a view of a cached one."""

    def __init__(self, name: str, nbytes: int, *, mapped: memoryview | None = None) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        if mapped is not None:  # a mapping the backend keeps across transfers
            buf = mapped
        elif (own := _map_segment(name, nbytes)) is not None:
            self._map, buf = own, memoryview(own)
        else:  # pragma: no cover - non-Linux hosts
            try:
                self._shm = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                raise UnavailableError(f"shared-memory segment {name} not found") from None
            # NOTE: before Python 3.13 attaching registers the segment with our resource
            # tracker, which would unlink it when this process exits.
            resource_tracker.unregister(f"/{name}", "shared_memory")
            buf = self._shm.buf
        self._view: memoryview | None = buf[:nbytes]

    @property
    def view(self) -> memoryview:
        """The whole region, writable: a producer may fill it directly."""
        if self._view is None:
            raise UnavailableError("shared-memory writer is closed")
        return self._view

    async def write(self, index: int, offset: int, data: memoryview) -> None:
        self.view[offset : offset + data.nbytes] = data

    async def finish(self) -> None:
        """Stores to a shared mapping are visible to the relay once written; nothing to flush."""

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            _drop(self._map)
            self._map = None
        if self._shm is not None:  # pragma: no cover - non-Linux hosts
            self._shm.close()
            self._shm = None


class ShmSenderBackend:
    """Opens writers on the relay's segments, keeping each segment's mapping for its reuse.

    NOTE: a kept mapping of a segment the relay has since unlinked pins its memory, so every
    open first drops those (a stat per kept segment), and at most ``max_mapped_bytes`` stay.
    """

    transport = Transport.SHM

    def __init__(self, max_mapped_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_mapped_bytes < 0:
            raise ValueError(f"max_mapped_bytes: must be >= 0, got {max_mapped_bytes}")
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()  # name → (map, ino)

    @property
    def mapped_bytes(self) -> int:
        return sum(len(m) for m, _ in self._maps.values())

    async def open(self, reservation: Reservation, header: TransferHeader) -> ShmWriter:
        name, nbytes = reservation.shm_name, reservation.total_bytes
        if not name:
            raise UnavailableError("the reservation names no shared-memory segment")
        if not self.max_mapped_bytes:
            # Mapping with MAP_POPULATE walks the page tables: milliseconds for large regions.
            return await asyncio.to_thread(ShmWriter, name, nbytes)
        self._forget_unlinked()
        kept = self._maps.get(name)
        if kept is None or len(kept[0]) < nbytes:
            kept = await asyncio.to_thread(_map_whole, name, nbytes)
            self._maps[name] = kept
            self._evict(keep=name)
        self._maps.move_to_end(name)
        return ShmWriter(name, nbytes, mapped=memoryview(kept[0]))

    def close(self) -> None:
        while self._maps:
            _drop(self._maps.popitem()[1][0])

    def _forget_unlinked(self) -> None:
        for name, (mapping, ino) in list(self._maps.items()):
            try:
                alive = os.stat(os.path.join(_DEV_SHM, name)).st_ino == ino
            except FileNotFoundError:
                alive = False
            if not alive:
                del self._maps[name]
                _drop(mapping)

    def _evict(self, keep: str) -> None:
        while self.mapped_bytes > self.max_mapped_bytes and next(iter(self._maps)) != keep:
            _drop(self._maps.popitem(last=False)[1][0])


def _map_whole(name: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """The whole segment ``name`` (at least ``nbytes``) mapped and populated, and its inode."""
    path = os.path.join(_DEV_SHM, name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UnavailableError(
            f"shared-memory segment {name} not found (not on this host, or its lease expired)"
        ) from None
    mapping = _map_segment(name, max(nbytes, st.st_size))
    if mapping is None:  # pragma: no cover - non-Linux hosts
        raise UnavailableError("shared-memory mappings need /dev/shm and MAP_POPULATE")
    return mapping, st.st_ino
