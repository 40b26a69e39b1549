"""What the fast link's backends share: the records of the handshake, and the
two small interfaces a transport implements.

Handshake (``RelayService``):

1. prefill → ``PrepareTransfer(PrepareRequest)``: the relay picks the first
   transport it supports from the sender's list, allocates a ``Region`` of
   ``total_bytes`` (an RDMA-registered buffer, a shared-memory segment, or
   plain memory for TCP) and answers a ``Reservation`` — transfer id, lease,
   and how to reach the region (``shm_name`` / ``rdma``);
2. prefill writes the bytes through a ``RegionWriter`` (RDMA WRITE, a memcpy
   into the mapped segment, or a ``PushKv`` chunk stream for TCP);
3. prefill → ``CompleteTransfer(Completion)`` with the CRC-32 of the whole
   region; the relay checks it over its own memory before decoding.

Everything but the bytes' path is in ``receiver.py`` / ``sender.py`` and is the
same for all three transports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdd.kv.fast_link.state import Transport
from pdd.kv.layout import KvLayout
from pdd.kv.transfer import TransferHeader


@dataclass(frozen=True)
class RdmaEndpointInfo:
    """Queue-pair facts a peer needs to post one-sided RDMA writes into a region."""

    remote_addr: int
    rkey: int
    qp_num: int
    lid: int
    gid: bytes
    psn: int


@dataclass(frozen=True)
class PrepareRequest:
    request_id: str
    layout: KvLayout
    num_tokens: int
    total_bytes: int
    # Transports the sender can use, best first; empty: the receiver's choice.
    transports: tuple[Transport, ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must not be empty")
        if self.total_bytes != self.layout.nbytes(self.num_tokens):
            raise ValueError(
                f"total_bytes: {self.total_bytes} != {self.num_tokens} tokens x "
                f"{self.layout.bytes_per_token} bytes per token"
            )


@dataclass(frozen=True)
class Reservation:
    transfer_id: str
    request_id: str
    transport: Transport
    total_bytes: int
    # How long the region stays reserved without a completion.
    lease_ms: int
    shm_name: str = ""
    rdma: RdmaEndpointInfo | None = None


@dataclass(frozen=True)
class Completion:
    transfer_id: str
    header: TransferHeader
    # zlib.crc32 of the whole region as the sender wrote it.
    crc32: int
    output_token_ids: tuple[int, ...] = ()


class Region(Protocol):
    """Receiver-side memory of one transfer."""

    shm_name: str
    rdma: RdmaEndpointInfo | None

    @property
    def view(self) -> memoryview:
        """The whole region, writable, without a copy."""
        ...

    def close(self, reuse: bool = False) -> None:
        """Give the memory back (unlink / deregister); idempotent. ``reuse``: the transfer
        completed, so no sender writes here any more and the memory may serve another one."""
        ...


class ReceiverBackend(Protocol):
    transport: Transport

    def allocate(self, transfer_id: str, nbytes: int) -> Region: ...


class RegionWriter(Protocol):
    """Sender-side handle on a reserved region."""

    async def write(self, index: int, offset: int, data: memoryview) -> None:
        """Write chunk ``index`` (bytes ``[offset, offset + len(data))``)."""
        ...

    async def finish(self) -> None:
        """Return once every byte written is in the receiver's memory."""
        ...

    def close(self) -> None: ...


class SenderBackend(Protocol):
    transport: Transport

    async def open(self, reservation: Reservation, header: TransferHeader) -> RegionWriter: ...


class MemoryRegion:
    """A region in this process's memory (the TCP transport's landing buffer)."""

    shm_name = ""
    rdma: RdmaEndpointInfo | None = None

    def __init__(self, nbytes: int) -> None:
        self._buffer: bytearray | None = bytearray(nbytes)

    @property
    def view(self) -> memoryview:
        if self._buffer is None:
            raise ValueError("region: closed")
        return memoryview(self._buffer)

    def close(self, reuse: bool = False) -> None:
        self._buffer = None
