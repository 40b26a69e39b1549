"""Where a sender reads the KV bytes it pushes: ``KvSource``.

A transfer reads its payload span by span (one chunk at a time) through
``await source.read(offset, length)``. The read waits until the producer has
produced that span, so a prefill that is still computing later layers can start
the push with the first ones. Senders read ahead by at most a bounded number of
chunks, so a slow link holds the producer back instead of piling up encoded
chunks (back-pressure).

A span may be read again later: a resumed push resends chunks the receiver
lacks. ``StreamedSource`` therefore keeps what it pulled — bounded by the
payload's declared size, like the sender's KV pool that holds the same bytes.
``FilledSource`` is the push form: its producer writes the payload in place
(prefill exports KV straight into it: no queue of pieces, no second copy).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import Protocol

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError


class KvSource(Protocol):
    @property
    def total_bytes(self) -> int: ...

    async def read(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of the payload, once produced."""
        ...

    async def ready(self, nbytes: int) -> None:
        """Until the payload's first ``nbytes`` are produced (a push asks for a pool slot only
        then); not a read: a meter wrapping the source counts nothing for it."""
        ...


def _check_span(offset: int, length: int, total: int) -> None:
    if offset < 0 or length < 0 or offset + length > total:
        raise InvalidArgumentError(
            "span", f"[{offset}, {offset + length}) outside the payload of {total} bytes"
        )


class BytesSource:
    """A payload already in memory; reads are zero-copy views."""

    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(payload).cast("B")

    @property
    def total_bytes(self) -> int:
        return self._view.nbytes

    async def ready(self, nbytes: int) -> None:
        _check_span(0, nbytes, self.total_bytes)

    async def read(self, offset: int, length: int) -> memoryview:
        _check_span(offset, length, self._view.nbytes)
        return self._view[offset : offset + length]


class StreamedSource:
    """A payload produced piece by piece by an async iterator, pulled only as far as reads need."""

    def __init__(
        self, total_bytes: int, pieces: AsyncIterable[bytes | bytearray | memoryview]
    ) -> None:
        if total_bytes < 0:
            raise ValueError(f"total_bytes: must be >= 0, got {total_bytes}")
        self._total = total_bytes
        self._buffer = bytearray(total_bytes)
        self._pieces: AsyncIterator[bytes | bytearray | memoryview] = aiter(pieces)
        self._produced = 0
        self._lock = asyncio.Lock()

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def produced(self) -> int:
        """Bytes pulled from the producer so far."""
        return self._produced

    async def ready(self, nbytes: int) -> None:
        await self.read(0, nbytes)

    async def read(self, offset: int, length: int) -> memoryview:
        _check_span(offset, length, self._total)
        end = offset + length
        if self._produced < end:
            async with self._lock:  # one puller at a time keeps pieces in order
                while self._produced < end:
                    try:
                        piece = await anext(self._pieces)
                    except StopAsyncIteration:
                        raise FailedPreconditionError(
                            f"KV producer stopped after {self._produced} of {self._total} bytes"
                        ) from None
                    piece = memoryview(piece).cast("B")
                    if self._produced + piece.nbytes > self._total:
                        raise InvalidArgumentError(
                            "payload", f"producer overran the declared {self._total} bytes"
                        )
                    self._buffer[self._produced : self._produced + piece.nbytes] = piece
                    self._produced += piece.nbytes
        return memoryview(self._buffer)[offset:end]


class FilledSource:
    """A payload buffer its producer writes in place, front to back; a read waits for its span.

    The producer asks for the next ``span(nbytes)`` (a writable view, e.g. the target of a
    tensor copy that casts KV to the wire dtype on the way), fills it and calls
    ``advance(nbytes)``. The buffer is the only copy of the payload on the sending side, kept
    for resends until the source is dropped.
    """

    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 0:
            raise ValueError(f"total_bytes: must be >= 0, got {total_bytes}")
        self._buffer = bytearray(total_bytes)
        self._produced = 0
        self._progress = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def total_bytes(self) -> int:
        return len(self._buffer)

    @property
    def produced(self) -> int:
        """Bytes the producer has filled so far."""
        return self._produced

    def span(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` of the buffer, for the producer to fill (then ``advance``)."""
        return self.region(self._produced, nbytes)

    def region(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` of the buffer from ``offset``: a producer on another thread writes ahead of
        what the event loop has advanced, then has each ``advance`` posted there in turn."""
        if nbytes < 0 or offset < 0 or offset + nbytes > len(self._buffer):
            raise InvalidArgumentError(
                "payload", f"producer overran the declared {len(self._buffer)} bytes"
            )
        return memoryview(self._buffer)[offset : offset + nbytes]

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more were filled (call on the event loop: it wakes the readers)."""
        self.span(nbytes)  # the same bound
        self._produced += nbytes
        self._progress.set()
        self._progress = asyncio.Event()

    def fail(self, error: BaseException) -> None:
        """The producer gave up: every read still waiting (and any later one) raises ``error``."""
        self._error = error
        self._progress.set()

    async def ready(self, nbytes: int) -> None:
        await self.read(0, nbytes)

    async def read(self, offset: int, length: int) -> memoryview:
        _check_span(offset, length, len(self._buffer))
        end = offset + length
        while self._produced < end:
            if self._error is not None:
                raise self._error
            await self._progress.wait()
        return memoryview(self._buffer)[offset:end]
