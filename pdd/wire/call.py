"""The typed peer clients' two shapes of call, and the one place a transport error becomes a
domain error.

``EventStream``: a server-streaming call read as domain events (``read()`` → event, or
None at the end). ``HandoffCall``: MainDecode's bidirectional token handoff, one batch in, one
acknowledgement out. Both raise ``PeerError`` (the peer's status name and message) instead of
gRPC's own exceptions, so the roles in ``pdd.serving`` are written against domain objects and
can be driven by an in-process peer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc

from pdd.core.errors import PeerError

E = TypeVar("E")
T = TypeVar("T")


def peer_error(exc: grpc.aio.AioRpcError, peer: str) -> PeerError:
    return PeerError(exc.code().name, exc.details() or exc.code().name, peer)


async def unary(peer: str, call: Awaitable[T]) -> T:
    """Await one unary call, its failure as a ``PeerError``."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise peer_error(exc, peer) from None


class EventStream(Generic[E]):
    """One server-streaming call, its messages converted to domain events as they arrive."""

    def __init__(self, peer: str, call: Any, convert: Callable[[Any], E]) -> None:
        self.peer = peer
        self._call = call
        self._convert = convert
        self._cancelled = False

    async def read(self) -> E | None:
        """The next event; None once the peer ended the stream. Cancelled by ``cancel``: a
        CANCELLED ``PeerError`` (grpc.aio raises CancelledError in a pending read)."""
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise peer_error(exc, self.peer) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # NOTE: only the call was cancelled, not the reading task: say so as a peer error.
            if self._cancelled and task is not None and not task.cancelling():
                raise PeerError("CANCELLED", "cancelled", self.peer) from None
            raise
        if msg is grpc.aio.EOF:
            return None
        return self._convert(msg)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[E]:
        while (event := await self.read()) is not None:
            yield event


class HandoffCall(Generic[E, T]):
    """A bidirectional stream of request batches, each answered by one acknowledgement."""

    def __init__(
        self, peer: str, call: Any, to_pb: Callable[[E], Any], from_pb: Callable[[Any], T]
    ) -> None:
        self.peer = peer
        self._call = call
        self._to_pb = to_pb
        self._from_pb = from_pb

    async def send(self, batch: E) -> T:
        """Write ``batch`` and wait for its acknowledgement."""
        try:
            await self._call.write(self._to_pb(batch))
            ack = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise peer_error(exc, self.peer) from None
        if ack is grpc.aio.EOF:
            raise PeerError("UNAVAILABLE", "closed the handoff stream before answering", self.peer)
        return self._from_pb(ack)

    async def done(self, *, wait: bool = False) -> None:
        """No more batches: let the peer end the stream; ``wait``: until it has (its status)."""
        try:
            await self._call.done_writing()
            while wait and await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            raise peer_error(exc, self.peer) from None

    def cancel(self) -> None:
        self._call.cancel()
