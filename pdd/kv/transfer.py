"""The records of one KV transfer: header, chunks, commit, status.

Life of a transfer (WAN ``PushKv`` and the fast link's TCP transport alike):

1. the sender describes the token range in a ``TransferHeader`` — layout,
   ``total_bytes`` of the (decompressed) payload and ``num_chunks``;
2. the payload goes as ``Chunk`` s — chunk ``i`` always covers the byte span
   ``chunk_span(header, i)`` of the payload, so the header alone fixes every
   chunk's offset and length and a receiver can check them on arrival;
3. a ``Commit`` closes the push (it carries the first sampled token(s));
4. the receiver answers with a ``TransferStatus``: what is missing, whether
   the transfer is complete. A resumed push resends only the missing chunks.

NOTE: chunks are balanced: with ``n`` chunks each spans ``ceil(total / n)``
bytes except the last. ``make_header`` picks ``n`` from a maximum chunk size,
so no chunk ever exceeds it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdd.kv.layout import KvLayout

DEFAULT_CHUNK_BYTES = 1 << 20


class Compression(enum.Enum):
    """General-purpose compressor applied to each chunk after the dtype cast."""

    NONE = "none"
    ZLIB = "zlib"


@dataclass(frozen=True)
class TransferHeader:
    request_id: str
    layout: KvLayout
    start_token: int
    num_tokens: int
    # Bytes of the whole range after decompression: layout.nbytes(num_tokens).
    total_bytes: int
    num_chunks: int
    compression: Compression = Compression.NONE
    # Prompt (and known output) the KV belongs to, for the receiver's radix cache.
    token_ids: tuple[int, ...] = ()
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must not be empty")
        if self.start_token < 0 or self.num_tokens < 0:
            raise ValueError(
                f"num_tokens: start_token and num_tokens must be >= 0, "
                f"got {self.start_token}, {self.num_tokens}"
            )
        if self.total_bytes != self.layout.nbytes(self.num_tokens):
            raise ValueError(
                f"total_bytes: {self.total_bytes} != {self.num_tokens} tokens x "
                f"{self.layout.bytes_per_token} bytes per token"
            )
        if self.total_bytes == 0 and self.num_chunks != 0:
            raise ValueError(f"num_chunks: an empty range has no chunks, got {self.num_chunks}")
        if self.total_bytes > 0 and not 1 <= self.num_chunks <= self.total_bytes:
            raise ValueError(
                f"num_chunks: must be in [1, total_bytes={self.total_bytes}], got {self.num_chunks}"
            )
        if self.num_chunks > 1 and (self.num_chunks - 1) * self.chunk_bytes >= self.total_bytes:
            raise ValueError(
                f"num_chunks: {self.num_chunks} balanced chunks of {self.total_bytes} bytes "
                f"leave the last one empty"
            )
        if not isinstance(self.compression, Compression):
            raise ValueError(f"compression: expected a Compression, got {self.compression!r}")

    @property
    def chunk_bytes(self) -> int:
        """The size of every chunk but possibly the last."""
        return -(-self.total_bytes // self.num_chunks) if self.num_chunks else 0


def num_chunks_for(total_bytes: int, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    if max_chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: must be positive, got {max_chunk_bytes}")
    return -(-total_bytes // max_chunk_bytes)


def make_header(
    request_id: str,
    layout: KvLayout,
    start_token: int,
    num_tokens: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    compression: Compression = Compression.NONE,
    token_ids: tuple[int, ...] = (),
    cache_salt: str = "",
) -> TransferHeader:
    """The header of a range of ``num_tokens`` tokens, cut into chunks of at most ``chunk_bytes``."""
    total = layout.nbytes(num_tokens)
    return TransferHeader(
        request_id,
        layout,
        start_token,
        num_tokens,
        total,
        num_chunks_for(total, chunk_bytes),
        compression,
        tuple(token_ids),
        cache_salt,
    )


def chunk_span(header: TransferHeader, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` inside the decompressed payload."""
    if not 0 <= index < header.num_chunks:
        raise ValueError(f"chunk.index: {index} outside [0, {header.num_chunks})")
    size = header.chunk_bytes
    offset = index * size
    return offset, min(size, header.total_bytes - offset)


@dataclass(frozen=True)
class Chunk:
    request_id: str
    index: int
    # Offset of this chunk inside the decompressed payload.
    offset: int
    # Bytes as sent (after compression); a view of the sender's payload or of the received
    # message where nothing needed a copy (``push_codec``).
    data: bytes | memoryview
    # zlib.crc32 of ``data``.
    crc32: int


@dataclass(frozen=True)
class Commit:
    request_id: str
    # Output tokens already sampled by the sender; their KV is not in the push.
    output_token_ids: tuple[int, ...] = ()


PushItem = TransferHeader | Chunk | Commit


@dataclass(frozen=True)
class TransferStatus:
    request_id: str
    known: bool
    num_chunks: int = 0
    # Chunks not yet received, or received with a bad checksum: resend these.
    missing: tuple[int, ...] = ()
    # Every chunk arrived intact and the commit was received.
    complete: bool = False
    bytes_received: int = 0
    chunks_received: int = 0
