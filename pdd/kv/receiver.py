"""The receiving end of WAN KV pushes: a registry of transfers keyed by request id.

Life of a transfer on MainDecode:

1. ``PushKv`` stream opens; its first item is the header → ``open`` creates a
   ``Reassembler`` (or finds the one a broken stream left: same header =
   resume, a different one is rejected). A new transfer's header first passes the
   consumer's ``check`` (MainDecode: it must be the KV a request there waits for);
2. chunks go to ``accept``: one that contradicts the header (index, offset, size) is
   refused, a resend included; then duplicates are ignored, bad CRC → stays missing;
3. the commit (``commit``, the check's too) carries the first sampled token(s) and
   ends the stream: anything after it is refused;
4. once every chunk is in *and* the commit arrived, the payload is delivered
   exactly once: ``on_complete`` is called and every ``wait_complete`` waiter
   (``Decode`` waiting for its KV, the relay's ``WaitKvReady``) wakes up;
5. the consumer imports the KV and calls ``pop`` to free it. The request id is
   remembered as done, so a late resend of the same range (the sender lost the
   final response) is answered "complete" and not delivered a second time.

``receive(items)`` runs steps 1-4 for one stream; ``status`` answers
``GetKvTransfer``. Transfers idle longer than ``ttl_s`` are dropped by
``expire``.

NOTE: all methods run on one event loop (the gRPC server's); nothing here is
thread-safe, and nothing needs to be.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

import structlog

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from pdd.kv.chunking import DEFAULT_MAX_TOTAL_BYTES, ChunkVerdict, Reassembler
from pdd.kv.transfer import (
    Chunk,
    Commit,
    Compression,
    PushItem,
    TransferHeader,
    TransferStatus,
    chunk_span,
)
from pdd.kv.waiters import Waiters

log = structlog.get_logger(__name__)
_DONE_REMEMBERED = 4096

# The consumer's say on a new transfer's header and on each commit: raises a domain error
# (``pdd.core.errors``) to refuse it.
PushCheck = Callable[[TransferHeader | Commit], None]


@dataclass(frozen=True)
class ReceiverConfig:
    # Largest single transfer accepted (a header declaring more is rejected).
    max_transfer_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    # Sum of the sizes of all transfers held (open or delivered and not popped).
    max_inflight_bytes: int = 4 * DEFAULT_MAX_TOTAL_BYTES
    # A transfer untouched this long is dropped by expire().
    ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_transfer_bytes <= 0:
            raise ValueError(f"max_transfer_bytes: must be positive, got {self.max_transfer_bytes}")
        if self.max_inflight_bytes < self.max_transfer_bytes:
            raise ValueError("max_inflight_bytes: must be >= max_transfer_bytes")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s: must be positive, got {self.ttl_s}")


@dataclass(frozen=True)
class ReceivedKv:
    header: TransferHeader
    payload: bytearray | memoryview
    output_token_ids: tuple[int, ...]
    # Bytes that crossed the wire for it (compressed, intact chunks only).
    wire_bytes: int
    # From the header's arrival to delivery.
    elapsed_s: float


class _Transfer:
    def __init__(self, header: TransferHeader, max_bytes: int, now: float) -> None:
        self.header = header
        self.reassembler = Reassembler(header, max_total_bytes=max_bytes)
        self.commit: Commit | None = None
        self.delivered: ReceivedKv | None = None
        self.opened_at = self.touched_at = now


class KvReceiver:
    def __init__(
        self,
        config: ReceiverConfig = ReceiverConfig(),
        *,
        on_complete: Callable[[ReceivedKv], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        check: PushCheck | None = None,
    ) -> None:
        self.config = config
        self._on_complete = on_complete
        self._clock = clock
        self.check = check
        self._transfers: dict[str, _Transfer] = {}
        self._done: OrderedDict[str, TransferHeader] = OrderedDict()
        self._waiters: Waiters[ReceivedKv] = Waiters("KV transfer")

    @property
    def inflight_bytes(self) -> int:
        return sum(t.header.total_bytes for t in self._transfers.values())

    def open(self, header: TransferHeader) -> TransferStatus:
        rid = header.request_id
        t = self._transfers.get(rid)
        if t is not None:
            if t.header != header:
                raise InvalidArgumentError(
                    "header", f"conflicts with the transfer of {rid} in progress"
                )
            t.touched_at = self._clock()
            return self.status(rid)
        if self._done.get(rid) == header:
            return self.status(rid)
        if self.check is not None:
            self.check(header)
        self.expire()
        if self.inflight_bytes + header.total_bytes > self.config.max_inflight_bytes:
            raise ResourceExhaustedError(
                f"KV receiver holds {self.inflight_bytes} bytes; {rid} needs "
                f"{header.total_bytes} more (limit {self.config.max_inflight_bytes})"
            )
        self._done.pop(rid, None)
        self._transfers[rid] = _Transfer(header, self.config.max_transfer_bytes, self._clock())
        return self.status(rid)

    def accept(self, chunk: Chunk) -> ChunkVerdict:
        t = self._transfers.get(chunk.request_id)
        if t is None:
            if (done := self._done.get(chunk.request_id)) is not None:
                _check_shape(done, chunk)
                return ChunkVerdict.DUPLICATE
            raise FailedPreconditionError(f"KV chunk for {chunk.request_id} before its header")
        _check_shape(t.header, chunk)
        t.touched_at = self._clock()
        if t.delivered is not None:
            return ChunkVerdict.DUPLICATE
        verdict = t.reassembler.accept(chunk)
        if verdict is ChunkVerdict.CORRUPT:
            log.warning("kv_chunk_corrupt", request_id=chunk.request_id, index=chunk.index)
        self._maybe_deliver(t)
        return verdict

    def commit(self, commit: Commit) -> TransferStatus:
        t = self._transfers.get(commit.request_id)
        if t is None:
            if commit.request_id in self._done:
                return self.status(commit.request_id)
            raise FailedPreconditionError(f"KV commit for {commit.request_id} before its header")
        t.touched_at = self._clock()
        if t.commit is None and t.delivered is None:
            if self.check is not None:
                self.check(commit)
            t.commit = commit
        self._maybe_deliver(t)
        return self.status(commit.request_id)

    async def receive(self, items: AsyncIterable[PushItem]) -> TransferStatus:
        """One ``PushKv`` stream: header, chunks (any order), commit. Returns the final status."""
        rid: str | None = None
        committed = False
        async for item in items:
            if committed:
                raise InvalidArgumentError(_field(item), "follows the commit, which ends a push")
            if rid is None:
                if not isinstance(item, TransferHeader):
                    raise InvalidArgumentError(
                        "header", "the first message of a push must be the header"
                    )
                rid = item.request_id
                self.open(item)
            elif isinstance(item, TransferHeader):
                raise InvalidArgumentError("header", "a push carries one header")
            elif item.request_id != rid:
                raise InvalidArgumentError(
                    f"{_field(item)}.request_id",
                    f"{item.request_id!r} does not match the header's {rid!r}",
                )
            elif isinstance(item, Chunk):
                self.accept(item)
            else:
                self.commit(item)
                committed = True
        if rid is None:
            raise InvalidArgumentError("header", "the push was empty")
        return self.status(rid)

    def status(self, request_id: str) -> TransferStatus:
        t = self._transfers.get(request_id)
        if t is None:
            done = self._done.get(request_id)
            if done is None:
                return TransferStatus(request_id, known=False)
            return TransferStatus(
                request_id, True, done.num_chunks, (), True, done.total_bytes, done.num_chunks
            )
        r = t.reassembler
        return TransferStatus(
            request_id,
            True,
            t.header.num_chunks,
            tuple(r.missing()),
            t.delivered is not None,
            r.bytes_received,
            r.chunks_received,
        )

    async def wait_complete(self, request_id: str, timeout_s: float) -> ReceivedKv:
        """The delivered transfer, waiting up to ``timeout_s`` (its header may not even be here yet)."""
        t = self._transfers.get(request_id)
        if t is not None and t.delivered is not None:
            return t.delivered
        return await self._waiters.wait(request_id, timeout_s)

    def pop(self, request_id: str) -> ReceivedKv | None:
        """Hand the delivered KV over and forget its bytes (the id is remembered as done)."""
        t = self._transfers.get(request_id)
        if t is None or t.delivered is None:
            return None
        del self._transfers[request_id]
        self._remember_done(t.header)
        return t.delivered

    def discard(self, request_id: str) -> bool:
        """Drop a transfer (request cancelled); waiters get ``FailedPreconditionError``."""
        dropped = self._transfers.pop(request_id, None) is not None
        self._waiters.fail(
            request_id, FailedPreconditionError(f"KV transfer of {request_id} was cancelled")
        )
        return dropped

    def expire(self) -> list[str]:
        """Drop transfers idle longer than ``ttl_s``; returns their request ids."""
        now = self._clock()
        stale = [
            rid for rid, t in self._transfers.items() if now - t.touched_at > self.config.ttl_s
        ]
        for rid in stale:
            del self._transfers[rid]
            log.warning("kv_transfer_expired", request_id=rid)
        return stale

    def _remember_done(self, header: TransferHeader) -> None:
        self._done[header.request_id] = header
        self._done.move_to_end(header.request_id)
        while len(self._done) > _DONE_REMEMBERED:
            self._done.popitem(last=False)

    def _maybe_deliver(self, t: _Transfer) -> None:
        if t.delivered is not None or t.commit is None or not t.reassembler.complete:
            return
        r = t.reassembler
        t.delivered = ReceivedKv(
            t.header,
            r.take(),
            t.commit.output_token_ids,
            r.wire_bytes_received,
            self._clock() - t.opened_at,
        )
        log.info(
            "kv_transfer_complete",
            request_id=t.header.request_id,
            bytes=t.header.total_bytes,
            wire_bytes=r.wire_bytes_received,
            duplicates=r.duplicates,
            corrupt=r.corrupt,
        )
        self._waiters.resolve(t.header.request_id, t.delivered)
        if self._on_complete is not None:
            try:
                self._on_complete(t.delivered)
            except Exception:  # noqa: BLE001 — the consumer's failure must not fail the sender's stream
                log.exception("kv_on_complete_failed", request_id=t.header.request_id)


def _field(item: PushItem) -> str:
    """The name of a push item's message field (``PushKvRequest.item``)."""
    return "header" if isinstance(item, TransferHeader) else type(item).__name__.lower()


def _check_shape(header: TransferHeader, chunk: Chunk) -> None:
    """Refuse a chunk that contradicts its header: index, offset, or (uncompressed) size.

    NOTE: before the duplicate check, so a malformed resend is refused as such instead of being
    ignored as a duplicate (the ``Reassembler`` checks a new chunk the same way).
    """
    if not 0 <= chunk.index < header.num_chunks:
        raise InvalidArgumentError("chunk.index", f"{chunk.index} outside [0, {header.num_chunks})")
    offset, length = chunk_span(header, chunk.index)
    if chunk.offset != offset:
        raise InvalidArgumentError(
            "chunk.offset", f"chunk {chunk.index} starts at {offset}, got {chunk.offset}"
        )
    if header.compression is Compression.NONE and len(chunk.data) != length:
        raise InvalidArgumentError(
            "chunk.data", f"chunk {chunk.index} spans {length} bytes, got {len(chunk.data)}"
        )
