"""Cutting a KV payload into checksummed chunks, and putting it back together.

Sender: ``encode_chunk(header, index, raw)`` compresses the span
``chunk_span(header, index)`` of the payload and stamps it with its CRC-32;
``split`` does that for a whole in-memory payload.

Receiver: one ``Reassembler`` per transfer. Chunks arrive in any order and
possibly twice (a resumed push resends what the receiver did not confirm):

- a duplicate of an index already held is ignored;
- a chunk whose CRC does not match its bytes is dropped and its index stays in
  ``missing()``, so the sender's next round resends it;
- a chunk that passes its CRC but contradicts the header (wrong offset, wrong
  inflated length, unknown index) is a sender bug: ``InvalidArgumentError``.

NOTE: memory is bounded by the header's ``total_bytes``, itself capped by
``max_total_bytes``; the payload buffer is the only copy, written in place and
handed out once by ``take()``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from pdd.kv.checksum import crc32
from pdd.kv.compression import compress_chunk, decompress_chunk
from pdd.kv.transfer import Chunk, TransferHeader, chunk_span

DEFAULT_MAX_TOTAL_BYTES = 8 << 30
# NOTE: the per-chunk bookkeeping (and a status listing missing indices) grows with
# the chunk count, so a header may not declare more chunks than this.
MAX_CHUNKS = 1 << 20


class ChunkVerdict(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    CORRUPT = "corrupt"


def encode_chunk(
    header: TransferHeader, index: int, raw: bytes | bytearray | memoryview, *, level: int = 1
) -> Chunk:
    """Chunk ``index`` from its raw (decompressed) bytes."""
    offset, length = chunk_span(header, index)
    if len(raw) != length:
        raise InvalidArgumentError("chunk", f"chunk {index} spans {length} bytes, got {len(raw)}")
    data = compress_chunk(raw, header.compression, level)
    return Chunk(header.request_id, index, offset, data, crc32(data))


def split(
    header: TransferHeader, payload: bytes | bytearray | memoryview, *, level: int = 1
) -> Iterator[Chunk]:
    """Every chunk of an in-memory payload, in order."""
    view = memoryview(payload).cast("B")
    if view.nbytes != header.total_bytes:
        raise InvalidArgumentError(
            "payload", f"has {view.nbytes} bytes, header says {header.total_bytes}"
        )
    for i in range(header.num_chunks):
        offset, length = chunk_span(header, i)
        yield encode_chunk(header, i, view[offset : offset + length], level=level)


def check_header(header: TransferHeader, max_total_bytes: int) -> None:
    """Reject a header whose declared size is over what the receiver accepts."""
    if header.total_bytes > max_total_bytes:
        raise ResourceExhaustedError(
            f"KV transfer {header.request_id}: {header.total_bytes} bytes "
            f"exceeds the limit of {max_total_bytes}"
        )
    if header.num_chunks > MAX_CHUNKS:
        raise InvalidArgumentError(
            "header.num_chunks", f"{header.num_chunks} exceeds the limit of {MAX_CHUNKS}"
        )


class Reassembler:
    """Collects one transfer's chunks into its payload buffer."""

    def __init__(
        self,
        header: TransferHeader,
        *,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        buffer: memoryview | None = None,
    ) -> None:
        check_header(header, max_total_bytes)
        self.header = header
        if buffer is not None:
            # A caller-owned region (e.g. a fast-link shared-memory segment): written in place.
            buffer = memoryview(buffer).cast("B")
            if buffer.readonly or buffer.nbytes != header.total_bytes:
                raise InvalidArgumentError(
                    "buffer", f"must be a writable region of {header.total_bytes} bytes"
                )
        self._buffer: bytearray | memoryview | None = (
            buffer if buffer is not None else bytearray(header.total_bytes)
        )
        self._received = bytearray(header.num_chunks)  # 1 where an intact chunk landed
        self.chunks_received = 0
        self.bytes_received = 0  # decompressed
        self.wire_bytes_received = 0  # as sent, intact chunks only
        self.duplicates = 0
        self.corrupt = 0
        self._taken = False

    @property
    def complete(self) -> bool:
        return self.chunks_received == self.header.num_chunks

    def missing(self) -> list[int]:
        """Indices still to be (re)sent, ascending."""
        return [i for i, got in enumerate(self._received) if not got]

    def accept(self, chunk: Chunk) -> ChunkVerdict:
        header = self.header
        if chunk.request_id != header.request_id:
            raise InvalidArgumentError(
                "chunk.request_id",
                f"{chunk.request_id!r} does not match the header's {header.request_id!r}",
            )
        if not 0 <= chunk.index < header.num_chunks:
            raise InvalidArgumentError(
                "chunk.index", f"{chunk.index} outside [0, {header.num_chunks})"
            )
        if self._received[chunk.index]:
            self.duplicates += 1
            return ChunkVerdict.DUPLICATE
        if crc32(chunk.data) != chunk.crc32:
            self.corrupt += 1
            return ChunkVerdict.CORRUPT
        offset, length = chunk_span(header, chunk.index)
        if chunk.offset != offset:
            raise InvalidArgumentError(
                "chunk.offset", f"chunk {chunk.index} starts at {offset}, got {chunk.offset}"
            )
        if self._taken or self._buffer is None:
            raise FailedPreconditionError(f"KV transfer {header.request_id}: payload already taken")
        raw = decompress_chunk(chunk.data, header.compression, length)
        # NOTE: through a memoryview: a bytearray slice assigned ``bytes`` copies them into a
        # temporary bytearray first (CPython), a fresh MiB for every chunk.
        memoryview(self._buffer)[offset : offset + length] = raw
        self._received[chunk.index] = 1
        self.chunks_received += 1
        self.bytes_received += length
        self.wire_bytes_received += len(chunk.data)
        return ChunkVerdict.ACCEPTED

    def take(self) -> bytearray | memoryview:
        """The payload, once, when complete; the reassembler keeps no reference."""
        if not self.complete:
            raise FailedPreconditionError(
                f"KV transfer {self.header.request_id}: {len(self.missing())} chunks still missing"
            )
        if self._taken or self._buffer is None:
            raise FailedPreconditionError(
                f"KV transfer {self.header.request_id}: payload already taken"
            )
        payload, self._buffer, self._taken = self._buffer, None, True
        return payload
