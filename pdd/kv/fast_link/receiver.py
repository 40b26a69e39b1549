"""The relay's side of the fast link, the same for RDMA, shared memory and TCP.

Life of a transfer here (states from ``state.py``):

1. ``prepare`` (``PrepareTransfer``): pick the first transport of the sender's
   list this relay has, allocate a region of ``total_bytes`` (off the event
   loop: pinning/prefaulting takes milliseconds), start its lease → REGISTERED,
   and answer a ``Reservation`` saying how to reach the region;
2. the sender writes: one-sided for RDMA and shm (invisible here), or through
   ``receive_chunks`` (TCP ``PushKv``: chunks reassembled in place) → WRITING;
3. ``complete`` (``CompleteTransfer``): WRITTEN; the CRC-32 of the region is
   computed here, over our own memory, and compared with the sender's →
   COMPLETED (waiters of ``wait_complete`` get a zero-copy view of the region)
   or FAILED (region freed at once). On a trusted transport (shm, RDMA: nothing
   between the sender's copy and our memory can change a byte) the check is
   skipped unless ``FastLinkConfig.verify_trusted``;
4. the consumer (the relay's engine) imports the KV and calls ``release``; the
   region's memory may then serve a later transfer (shm: the segment pool).

A transfer not completed within its lease → EXPIRED by ``expire`` (which
``run_sweeper`` calls periodically) and its region is freed; a later
``complete`` for it is refused.

NOTE: a region is freed exactly once, when its transfer leaves the registry
(release, cancel, FAILED or EXPIRED) — never while a sender may still be told to
write into it under a live lease.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass

import structlog

from pdd.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from pdd.kv.checksum import crc32_async
from pdd.kv.chunking import Reassembler
from pdd.kv.fast_link.region import Completion, PrepareRequest, ReceiverBackend, Region, Reservation
from pdd.kv.fast_link.state import TransferState, Transport, advance
from pdd.kv.transfer import Chunk, TransferHeader
from pdd.kv.waiters import Waiters

log = structlog.get_logger(__name__)
_ENDED_REMEMBERED = 4096


@dataclass(frozen=True)
class FastLinkConfig:
    # How long a region stays reserved without a completion.
    lease_s: float = 30.0
    max_region_bytes: int = 8 << 30
    # Sum of all regions held (reserved or completed and not yet released).
    max_reserved_bytes: int = 32 << 30
    # Check the region CRC on trusted transports too (``Transport.trusted``); the sender must
    # hash them as well (``FastLinkSender(hash_trusted=True)``). A debugging aid: it costs two
    # passes over the region, more than the copy itself.
    verify_trusted: bool = False

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be positive, got {self.lease_s}")
        if self.max_region_bytes <= 0 or self.max_reserved_bytes < self.max_region_bytes:
            raise ValueError("max_reserved_bytes: must be >= max_region_bytes > 0")


@dataclass(frozen=True)
class ReceivedRegion:
    transfer_id: str
    transport: Transport
    header: TransferHeader
    output_token_ids: tuple[int, ...]
    # The region itself, not a copy: valid until ``release(transfer_id)``.
    view: memoryview


class _Entry:
    def __init__(
        self, transfer_id: str, request: PrepareRequest, transport: Transport, deadline: float
    ) -> None:
        self.transfer_id = transfer_id
        self.request = request
        self.transport = transport
        self.deadline = deadline
        self.state = TransferState.PENDING
        self.region: Region | None = None
        self.reassembler: Reassembler | None = None
        self.result: ReceivedRegion | None = None


class FastLinkReceiver:
    def __init__(
        self,
        backends: Sequence[ReceiverBackend],
        config: FastLinkConfig = FastLinkConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not backends:
            raise ValueError("backends: at least one transport is needed")
        self._backends = {b.transport: b for b in backends}
        self.config = config
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        # Transfers that ended FAILED or EXPIRED (region freed), remembered for state() / complete().
        self._ended: OrderedDict[str, TransferState] = OrderedDict()
        self._waiters: Waiters[ReceivedRegion] = Waiters("fast-link KV")

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(self._backends)

    @property
    def held_regions(self) -> int:
        """Regions reserved and not yet freed (a soak checks this returns to 0 when idle)."""
        return len(self._entries)

    @property
    def reserved_bytes(self) -> int:
        return sum(e.request.total_bytes for e in self._entries.values())

    def state(self, transfer_id: str) -> TransferState:
        ended = self._ended.get(transfer_id)
        return ended if ended is not None else self._entry(transfer_id).state

    async def prepare(self, request: PrepareRequest) -> Reservation:
        transport = next(
            (t for t in request.transports or self.transports if t in self._backends), None
        )
        if transport is None:
            offered, have = (
                [t.value for t in request.transports],
                [t.value for t in self.transports],
            )
            raise UnavailableError(
                f"no common fast-link transport: sender offers {offered}, relay has {have}"
            )
        if request.total_bytes > self.config.max_region_bytes:
            raise ResourceExhaustedError(
                f"fast-link region of {request.total_bytes} bytes exceeds the limit of "
                f"{self.config.max_region_bytes}"
            )
        self.expire()
        if self.reserved_bytes + request.total_bytes > self.config.max_reserved_bytes:
            raise ResourceExhaustedError(
                f"fast link holds {self.reserved_bytes} bytes; limit "
                f"{self.config.max_reserved_bytes}"
            )
        entry = _Entry(uuid.uuid4().hex, request, transport, self._clock() + self.config.lease_s)
        self._entries[entry.transfer_id] = entry
        try:
            entry.region = await asyncio.to_thread(
                self._backends[transport].allocate, entry.transfer_id, request.total_bytes
            )
        except OSError as e:
            self._finish(entry, TransferState.FAILED)
            raise ResourceExhaustedError(
                f"cannot allocate a {transport.value} region of {request.total_bytes} bytes: {e}"
            ) from e
        if (
            self._entries.get(entry.transfer_id) is not entry
            or entry.state is not TransferState.PENDING
        ):
            entry.region.close()  # cancelled or expired while allocating
            raise FailedPreconditionError(
                f"fast-link transfer of {request.request_id} ended while allocating"
            )
        entry.state = advance(entry.state, TransferState.REGISTERED, entry.transfer_id)
        log.info(
            "fast_link_prepared",
            request_id=request.request_id,
            transfer_id=entry.transfer_id,
            transport=transport.value,
            bytes=request.total_bytes,
        )
        return Reservation(
            entry.transfer_id,
            request.request_id,
            transport,
            request.total_bytes,
            int(self.config.lease_s * 1000),
            entry.region.shm_name,
            entry.region.rdma,
        )

    async def receive_chunks(
        self, items: AsyncIterable[tuple[str, TransferHeader | Chunk]]
    ) -> tuple[int, int]:
        """A TCP ``PushKv`` stream into its region; returns (bytes, chunks) landed so far."""
        entry: _Entry | None = None
        async for transfer_id, item in items:
            if entry is None:
                entry = self._entry(transfer_id)
                if entry.transport is not Transport.TCP or not isinstance(item, TransferHeader):
                    raise InvalidArgumentError(
                        "header",
                        "a TCP fast-link push starts with the header of a "
                        "transfer prepared for TCP",
                    )
                self._check_header(entry, item)
                if entry.reassembler is None:
                    entry.state = advance(entry.state, TransferState.WRITING, transfer_id)
                    entry.reassembler = Reassembler(
                        item,
                        max_total_bytes=self.config.max_region_bytes,
                        buffer=entry.region.view if entry.region else None,
                    )
            elif transfer_id != entry.transfer_id or not isinstance(item, Chunk):
                raise InvalidArgumentError(
                    "chunk", "a push carries one header, then chunks of its transfer"
                )
            elif entry.state is not TransferState.WRITING:
                raise FailedPreconditionError(
                    f"fast-link transfer {transfer_id} is {entry.state.value}"
                )
            else:
                entry.reassembler.accept(item)
        if entry is None or entry.reassembler is None:
            raise InvalidArgumentError("header", "the push was empty")
        return entry.reassembler.bytes_received, entry.reassembler.chunks_received

    async def complete(self, completion: Completion) -> TransferState:
        """Check the region's CRC; COMPLETED (start decoding) or FAILED."""
        ended = self._ended.get(completion.transfer_id)
        if ended is TransferState.EXPIRED:
            raise FailedPreconditionError(
                f"fast-link transfer {completion.transfer_id}: lease expired"
            )
        if ended is not None:
            return ended
        entry = self._entry(completion.transfer_id)
        if entry.state.terminal:
            return entry.state
        self._check_header(entry, completion.header)
        entry.state = advance(entry.state, TransferState.WRITTEN, entry.transfer_id)
        if entry.reassembler is not None and not entry.reassembler.complete:
            log.warning(
                "fast_link_chunks_missing",
                transfer_id=entry.transfer_id,
                missing=len(entry.reassembler.missing()),
            )
            return self._finish(entry, TransferState.FAILED)
        if entry.region is None:
            raise FailedPreconditionError(f"fast-link transfer {entry.transfer_id} has no region")
        verify = self.config.verify_trusted or not entry.transport.trusted
        crc = await crc32_async(entry.region.view) if verify else completion.crc32
        if crc != completion.crc32:
            log.warning(
                "fast_link_crc_mismatch",
                transfer_id=entry.transfer_id,
                expected=completion.crc32,
                got=crc,
            )
            return self._finish(entry, TransferState.FAILED)
        entry.result = ReceivedRegion(
            entry.transfer_id,
            entry.transport,
            completion.header,
            completion.output_token_ids,
            entry.region.view,
        )
        entry.state = advance(entry.state, TransferState.COMPLETED, entry.transfer_id)
        self._waiters.resolve(entry.request.request_id, entry.result)
        log.info(
            "fast_link_completed",
            request_id=entry.request.request_id,
            transfer_id=entry.transfer_id,
            transport=entry.transport.value,
        )
        return entry.state

    async def wait_complete(self, request_id: str, timeout_s: float) -> ReceivedRegion:
        for entry in self._entries.values():
            if entry.request.request_id == request_id and entry.result is not None:
                return entry.result
        return await self._waiters.wait(request_id, timeout_s)

    def release(self, transfer_id: str) -> None:
        """The consumer is done with a COMPLETED region (or gives up on any transfer)."""
        entry = self._entries.pop(transfer_id, None)
        if entry is not None and entry.region is not None:
            # NOTE: only a completed transfer's sender is done writing; any other's may be late.
            entry.region.close(reuse=entry.state is TransferState.COMPLETED)

    def cancel(self, request_id: str) -> int:
        """Drop every transfer of a request; returns how many."""
        ids = [e.transfer_id for e in self._entries.values() if e.request.request_id == request_id]
        for tid in ids:
            self.release(tid)
        self._waiters.fail(
            request_id, FailedPreconditionError(f"fast-link transfer of {request_id} was cancelled")
        )
        return len(ids)

    def expire(self) -> list[str]:
        """Expire transfers whose lease ran out before completion; returns their transfer ids."""
        now = self._clock()
        stale = [
            e
            for e in self._entries.values()
            if e.state in (TransferState.PENDING, TransferState.REGISTERED, TransferState.WRITING)
            and now >= e.deadline
        ]
        for entry in stale:
            log.warning(
                "fast_link_lease_expired",
                transfer_id=entry.transfer_id,
                request_id=entry.request.request_id,
                state=entry.state.value,
            )
            self._finish(entry, TransferState.EXPIRED)
        return [e.transfer_id for e in stale]

    def close(self) -> None:
        """Shutting down: free every region still held and the backends' kept memory (the shm
        backend's idle segments, which would otherwise stay in /dev/shm until reboot)."""
        for tid in list(self._entries):
            self.release(tid)
        for backend in self._backends.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    async def run_sweeper(self, interval_s: float = 1.0) -> None:
        """Expire leases every ``interval_s`` until cancelled (a servicer runs it as a task)."""
        while True:
            self.expire()
            await asyncio.sleep(interval_s)

    def _entry(self, transfer_id: str) -> _Entry:
        try:
            return self._entries[transfer_id]
        except KeyError:
            raise NotFoundError(f"unknown fast-link transfer {transfer_id!r}") from None

    @staticmethod
    def _check_header(entry: _Entry, header: TransferHeader) -> None:
        req = entry.request
        if header.request_id != req.request_id or header.total_bytes != req.total_bytes:
            raise InvalidArgumentError(
                "header",
                f"does not match the prepared transfer ({req.request_id}, {req.total_bytes} bytes)",
            )

    def _finish(self, entry: _Entry, state: TransferState) -> TransferState:
        """End a transfer unsuccessfully and free its region.

        Waiters are not woken: the sender may prepare the request again (e.g. over
        TCP); they wait for that or for their own timeout.
        """
        entry.state = advance(entry.state, state, entry.transfer_id)
        self.release(entry.transfer_id)
        self._ended[entry.transfer_id] = state
        while len(self._ended) > _ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        return state
