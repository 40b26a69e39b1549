"""Fast-link transport of last resort: the KV as a ``RelayService/PushKv`` chunk stream.

The relay's region is plain memory; the stream's header and chunks (the same
``chunking`` records as the WAN path, CRC per chunk) are reassembled straight
into it by ``FastLinkReceiver.receive_chunks``. The sender's ``TcpWriter``
turns each ``write`` into a chunk on one open stream, with a bounded queue
between them (back-pressure), and ``finish`` closes the stream and waits for
the relay's count. Completion and its whole-region CRC are shared with the
other transports.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from pdd.core.errors import UnavailableError
from pdd.gen.relay.v1 import relay_service_pb2 as rpb
from pdd.kv import messages as convert
from pdd.kv.chunking import encode_chunk
from pdd.kv.fast_link.region import MemoryRegion, Reservation
from pdd.kv.fast_link.state import Transport
from pdd.kv.transfer import Chunk, TransferHeader

RelayPushFn = Callable[[AsyncIterator[rpb.PushKvRequest]], Awaitable[rpb.PushKvResponse]]


class TcpReceiverBackend:
    transport = Transport.TCP

    def allocate(self, transfer_id: str, nbytes: int) -> MemoryRegion:
        return MemoryRegion(nbytes)


class TcpWriter:
    def __init__(
        self,
        push: RelayPushFn,
        reservation: Reservation,
        header: TransferHeader,
        max_buffered_chunks: int,
    ) -> None:
        self._header = header
        self._transfer_id = reservation.transfer_id
        self._queue: asyncio.Queue[Chunk | None] = asyncio.Queue(maxsize=max_buffered_chunks)
        self._call = asyncio.ensure_future(push(self._requests()))

    async def _requests(self) -> AsyncIterator[rpb.PushKvRequest]:
        yield convert.relay_push_request_to_pb(self._transfer_id, self._header)
        while (chunk := await self._queue.get()) is not None:
            yield convert.relay_push_request_to_pb(self._transfer_id, chunk)

    async def _enqueue(self, item: Chunk | None) -> None:
        put = asyncio.ensure_future(self._queue.put(item))
        done, _ = await asyncio.wait({put, self._call}, return_when=asyncio.FIRST_COMPLETED)
        if put not in done:  # the stream ended under us
            put.cancel()
            await self._result()
            raise UnavailableError("fast-link TCP stream closed before every chunk was sent")

    async def _result(self) -> rpb.PushKvResponse:
        try:
            return await self._call
        except grpc.aio.AioRpcError as e:
            raise UnavailableError(
                f"fast-link TCP stream failed: {e.code().name}: {e.details()}"
            ) from e

    async def write(self, index: int, offset: int, data: memoryview) -> None:
        await self._enqueue(encode_chunk(self._header, index, data))

    async def finish(self) -> None:
        await self._enqueue(None)
        response = await self._result()
        if response.chunks_received != self._header.num_chunks:
            raise UnavailableError(
                f"relay received {response.chunks_received} of {self._header.num_chunks} chunks"
            )

    def close(self) -> None:
        if not self._call.done():
            self._call.cancel()
        elif not self._call.cancelled():
            self._call.exception()  # already reported by write/finish; mark it retrieved


class TcpSenderBackend:
    transport = Transport.TCP

    def __init__(self, push: RelayPushFn, *, max_buffered_chunks: int = 4) -> None:
        if max_buffered_chunks < 1:
            raise ValueError(f"max_buffered_chunks: must be >= 1, got {max_buffered_chunks}")
        self._push = push
        self._max_buffered = max_buffered_chunks

    @classmethod
    def for_stub(
        cls,
        stub: object,
        *,
        metadata: Sequence[tuple[str, str]] | None = None,
        max_buffered_chunks: int = 4,
    ) -> TcpSenderBackend:
        """Over a ``RelayServiceStub`` (``grpc.aio``)."""
        return cls(
            lambda requests: stub.PushKv(requests, metadata=metadata),  # type: ignore[attr-defined]
            max_buffered_chunks=max_buffered_chunks,
        )

    async def open(self, reservation: Reservation, header: TransferHeader) -> TcpWriter:
        return TcpWriter(self._push, reservation, header, self._max_buffered)
