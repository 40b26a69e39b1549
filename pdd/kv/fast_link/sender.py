"""Prefill's side of the fast link, the same for RDMA, shared memory and TCP.

Life of a send (``FastLinkSender.send``), after ``PrepareTransfer`` returned a
``Reservation``:

REGISTERED → open the region through the reservation's transport → WRITING:
each chunk span of the header is read from the ``KvSource`` (waiting for the
producer if it is still computing), written, and hashed in the background →
WRITTEN once the transport confirms every byte landed → ``CompleteTransfer``
with the whole region's CRC-32 → COMPLETED if the relay's own CRC agrees,
FAILED if not (the caller may prepare again, e.g. over TCP, or give up).

On a trusted transport (``Transport.trusted``: shm, RDMA) nothing is hashed and
the completion carries CRC 0, unless ``hash_trusted`` (for a relay that verifies
them: ``FastLinkConfig.verify_trusted``).

A transport error while writing also ends FAILED and raises the domain error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from pdd.core.errors import InvalidArgumentError, UnavailableError
from pdd.kv.checksum import ChunkedCrc
from pdd.kv.fast_link.region import Completion, Reservation, SenderBackend
from pdd.kv.fast_link.state import TransferState, Transport, advance
from pdd.kv.source import KvSource
from pdd.kv.transfer import TransferHeader, chunk_span

log = structlog.get_logger(__name__)

# ``RelayService/CompleteTransfer``: True (or COMPLETED, when calling a
# ``FastLinkReceiver.complete`` in-process) when the relay accepted the region.
CompleteFn = Callable[[Completion], Awaitable[bool | TransferState]]


@dataclass(frozen=True)
class SendReport:
    transfer_id: str
    transport: Transport
    state: TransferState
    total_bytes: int
    crc32: int
    # Reading the source and writing every byte into the region.
    write_s: float
    # The completion round trip, including the relay's CRC check.
    complete_s: float


class FastLinkSender:
    def __init__(self, backends: Sequence[SenderBackend], *, hash_trusted: bool = False) -> None:
        if not backends:
            raise ValueError("backends: at least one transport is needed")
        self._backends = {b.transport: b for b in backends}
        self.hash_trusted = hash_trusted

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(self._backends)

    async def send(
        self,
        reservation: Reservation,
        header: TransferHeader,
        source: KvSource,
        complete: CompleteFn,
        output_token_ids: Sequence[int] | asyncio.Future = (),
    ) -> SendReport:
        backend = self._backends.get(reservation.transport)
        if backend is None:
            raise UnavailableError(f"this sender has no {reservation.transport.value} transport")
        if not (header.total_bytes == reservation.total_bytes == source.total_bytes):
            raise InvalidArgumentError(
                "header.total_bytes",
                f"header {header.total_bytes}, reservation "
                f"{reservation.total_bytes}, source {source.total_bytes}",
            )
        state = TransferState.REGISTERED
        start = time.monotonic()
        writer = await backend.open(reservation, header)
        crc = ChunkedCrc() if self.hash_trusted or not reservation.transport.trusted else None
        try:
            state = advance(state, TransferState.WRITING, reservation.transfer_id)
            for index in range(header.num_chunks):
                offset, length = chunk_span(header, index)
                data = await source.read(offset, length)
                await writer.write(index, offset, data)
                if crc is not None:
                    crc.add(data)
            await writer.finish()
            state = advance(state, TransferState.WRITTEN, reservation.transfer_id)
            value = await crc.value() if crc is not None else 0
        except BaseException:
            log.warning(
                "fast_link_send_failed", transfer_id=reservation.transfer_id, state=state.value
            )
            raise
        finally:
            writer.close()
        written = time.monotonic()
        if isinstance(
            output_token_ids, asyncio.Future
        ):  # NOTE: known only once the producer finished
            output_token_ids = await output_token_ids
        outcome = await complete(
            Completion(reservation.transfer_id, header, value, tuple(output_token_ids))
        )
        accepted = outcome is True or outcome is TransferState.COMPLETED
        state = advance(
            state,
            TransferState.COMPLETED if accepted else TransferState.FAILED,
            reservation.transfer_id,
        )
        report = SendReport(
            reservation.transfer_id,
            reservation.transport,
            state,
            header.total_bytes,
            value,
            written - start,
            time.monotonic() - written,
        )
        log.info(
            "fast_link_sent",
            transfer_id=reservation.transfer_id,
            transport=reservation.transport.value,
            state=state.value,
            bytes=header.total_bytes,
            write_s=round(report.write_s, 4),
        )
        return report
