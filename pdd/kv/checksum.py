"""CRC-32 (zlib's polynomial) of KV chunks and whole fast-link regions.

The wire format fixes zlib's CRC-32. The stdlib's ``zlib.crc32`` runs at ~2 GB/s
on one core — slower than the memory copy it guards — so:

- where the ``isal`` package (ISA-L, carry-less-multiply CRC, ~10x faster) is
  installed, its ``crc32`` is used; it computes the identical value;
- otherwise large buffers are cut into pieces hashed on a thread pool
  (``zlib.crc32`` releases the GIL) and the piece CRCs are joined with
  ``crc32_combine`` (zlib's algorithm: multiply the first CRC by x^(8·len2)
  modulo the polynomial).

``ChunkedCrc`` hashes a region written chunk by chunk — on the fallback path
on a background thread, so hashing chunk k overlaps the copy of chunk k+1.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

try:
    from isal.isal_zlib import crc32 as _crc32

    ACCELERATED = True
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

    ACCELERATED = False

_POLY = 0xEDB88320  # reflected CRC-32 polynomial
_PARALLEL_MIN = 8 << 20  # below this one thread is as fast
_WORKERS = max(2, os.cpu_count() or 2)
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="pdd-crc")
    return _pool


def _multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial (reflected bit order); ``a`` must be non-zero."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


@lru_cache(maxsize=64)
def _x2nmodp(n: int) -> int:
    """x^(8·n) modulo the polynomial: shifts a CRC over n zero bytes."""
    p, k = 1 << 31, 3  # x^0; 2^3 bits per byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B from crc32(A), crc32(B) and len(B)."""
    return _multmodp(_x2nmodp(len2), crc1) ^ crc2


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, as fast as this host allows."""
    view = memoryview(data).cast("B")
    if ACCELERATED or view.nbytes < _PARALLEL_MIN:
        return _crc32(view, value)
    step = -(-view.nbytes // _WORKERS)
    pieces = [view[i : i + step] for i in range(0, view.nbytes, step)]
    for piece, c in zip(pieces, _executor().map(zlib.crc32, pieces), strict=True):
        value = crc32_combine(value, c, piece.nbytes)
    return value


async def crc32_async(data: bytes | bytearray | memoryview) -> int:
    """``crc32`` off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, crc32, data)


class ChunkedCrc:
    """CRC of a region written as consecutive chunks."""

    def __init__(self) -> None:
        self._value = 0
        self._parts: list[tuple[Future[int], int]] = []

    def add(self, data: memoryview) -> None:
        """Hash the next chunk: inline when accelerated (faster than a thread hand-off),
        else in the background — then ``data`` must stay unchanged until ``value()``."""
        if ACCELERATED:
            self._value = _crc32(data, self._value)
        else:
            self._parts.append((_executor().submit(zlib.crc32, data), data.nbytes))

    async def value(self) -> int:
        value = self._value
        for fut, size in self._parts:
            value = crc32_combine(value, await asyncio.wrap_future(fut), size)
        return value
