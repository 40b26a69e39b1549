"""The gateway's end of MainDecode's ``DecodeMany``: every request to one MainDecode on one stream.

``DecodeMux`` holds one ``DecodeMany`` call per MainDecode address, opened at the first request
and again after it broke. ``open(job)`` starts a request on it and returns a ``MuxStream``, which
reads like the ``EventStream`` of a ``Decode`` call (``read()`` → event, None at the end, a
``PeerError`` for a failure; ``cancel()``), so the gateway's request life does not know which of
the two it holds. Life of a call: a start message (job, deadline) goes out through the mux's
writer task; the reader task takes each incoming message — what one engine step made for every
request — and hands each event to its call's queue; the call's ``DecodeEnd`` is its end (OK: the
stream's end; otherwise the status as a ``PeerError``). A cancel, or the call's own deadline
(kept here too, so a MainDecode that stops answering cannot hold a request past it), sends a
cancel and ends the call at once. If the shared stream breaks, every call on it fails
UNAVAILABLE — to the gateway the same as each of their ``Decode`` calls failing with the peer —
and the next request opens a new stream. ``MuxStream.pipe`` lets the reader task hand a call's
events to callbacks instead (the gateway's request queue), skipping a queue and a task switch per
event.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable

import grpc

from pdd.core.errors import PeerError
from pdd.core.stage_events import DecodeEvent, DecodeJob
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
from pdd.wire import main_decode as conv
from pdd.wire.call import peer_error

_Item = DecodeEvent | conv.CallEnded | PeerError


class MuxStream:
    """One request's call on a shared ``DecodeMany`` stream, read as domain events."""

    def __init__(self, mux: DecodeMux, call_id: int) -> None:
        self.peer = mux.peer
        self.call_id = call_id
        self._mux = mux
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._end: _Item | None = None  # what ended the call, answered again to later reads
        self._timer: asyncio.TimerHandle | None = None
        # Set by ``pipe``: items go straight to these callbacks, not to the queue.
        self._on_event: Callable[[DecodeEvent], None] | None = None
        self._on_end: Callable[[PeerError | None], None] | None = None

    async def read(self) -> DecodeEvent | None:
        """The next event; None once the call ended OK; its failure as a ``PeerError``."""
        item = self._end if self._end is not None else await self._queue.get()
        if isinstance(item, conv.CallEnded | PeerError):
            self._end = item
            if (error := self._failure(item)) is not None:
                raise error
            return None
        return item

    def pipe(
        self, on_event: Callable[[DecodeEvent], None], on_end: Callable[[PeerError | None], None]
    ) -> None:
        """From now on hand every event to ``on_event`` as the shared stream's reader takes it,
        and the end to ``on_end`` once (None: the call ended OK; else its failure) — instead of
        ``read``, which must not be called again. What arrived before is handed over first.

        NOTE: a reader of many requests' tokens skips a queue and a task switch per event this
        way (what ``read`` in a loop costs); the callbacks run in the stream's reader task and
        must not block."""
        self._on_event, self._on_end = on_event, on_end
        if self._end is not None:
            self._hand(self._end)
            return
        while not self._queue.empty():
            if not self._hand(self._queue.get_nowait()):
                return

    def cancel(self) -> None:
        """Stop the call: MainDecode is told, and a pending read raises CANCELLED."""
        self._fail(PeerError("CANCELLED", "cancelled", self.peer))

    def _deliver(self, item: _Item) -> None:
        if isinstance(item, conv.CallEnded | PeerError) and self._timer is not None:
            self._timer.cancel()
        if self._on_event is None:
            self._queue.put_nowait(item)
        elif self._end is None:
            self._hand(item)

    def _hand(self, item: _Item) -> bool:
        """Give ``item`` to the pipe; False once it was the end."""
        assert self._on_event is not None and self._on_end is not None
        if isinstance(item, conv.CallEnded | PeerError):
            self._end = item
            self._on_end(self._failure(item))
            return False
        self._on_event(item)
        return True

    def _failure(self, end: conv.CallEnded | PeerError) -> PeerError | None:
        """What ended the call, as the failure it was; None for an OK end."""
        if isinstance(end, PeerError):
            return end
        return None if end.code == "OK" else PeerError(end.code, end.message or end.code, self.peer)

    def _expire(self) -> None:
        self._fail(PeerError("DEADLINE_EXCEEDED", "Deadline Exceeded", self.peer))

    def _fail(self, error: PeerError) -> None:
        if self._mux.forget(self.call_id):  # still running there: tell MainDecode to stop it
            self._deliver(error)

    async def __aiter__(self) -> AsyncIterator[DecodeEvent]:
        while (event := await self.read()) is not None:
            yield event


class DecodeMux:
    """One ``DecodeMany`` stream to one MainDecode, shared by every request sent to it."""

    def __init__(self, channel: grpc.aio.Channel, peer: str = "main_decode") -> None:
        self.peer = peer
        self._stub = pb_grpc.MainDecodeServiceStub(channel)
        self._ids = itertools.count(1)
        self._calls: dict[int, MuxStream] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def running(self) -> int:
        """Calls started and not yet ended."""
        return len(self._calls)

    def open(self, job: DecodeJob, timeout_s: float | None) -> MuxStream:
        """Start ``job`` on the shared stream (opened now if there is none)."""
        if self._call is None:
            self._connect()
        stream = MuxStream(self, next(self._ids))
        self._calls[stream.call_id] = stream
        self._send(conv.start_to_pb(conv.StartCall(stream.call_id, job, timeout_s)))
        if timeout_s is not None:
            loop = asyncio.get_running_loop()
            stream._timer = loop.call_later(timeout_s, stream._expire)
        return stream

    def forget(self, call_id: int) -> bool:
        """End ``call_id`` here and cancel it at MainDecode; False if it had already ended."""
        if self._calls.pop(call_id, None) is None:
            return False
        self._send(conv.cancel_to_pb(conv.CancelCall(call_id)))
        return True

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        self._fail_all(PeerError("CANCELLED", "the gateway closed its stream", self.peer))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _connect(self) -> None:
        # NOTE: no deadline and no request id: the stream outlives every request it carries.
        call = self._stub.DecodeMany()
        outbox: asyncio.Queue = asyncio.Queue()
        self._call, self._outbox = call, outbox
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks += [
            asyncio.create_task(self._write(call, outbox)),
            asyncio.create_task(self._read(call)),
        ]

    def _send(self, msg) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(msg)

    async def _write(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue) -> None:
        try:
            while (msg := await outbox.get()) is not None:
                await call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # NOTE: the reader sees the same failure and fails the calls

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error = PeerError("UNAVAILABLE", "main_decode ended the shared decode stream", self.peer)
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                for call_id, item in conv.many_events_from_pb(msg):
                    stream = self._calls.get(call_id)
                    if stream is None:
                        continue  # cancelled here, or already failed
                    if isinstance(item, conv.CallEnded):
                        del self._calls[call_id]
                    stream._deliver(item)
        except grpc.aio.AioRpcError as exc:
            # NOTE: the stream broke, not one request: every call on it lost its peer, whatever
            # the stream's status (a call's own status comes in its DecodeEnd).
            lost = peer_error(exc, self.peer)
            error = PeerError(
                "UNAVAILABLE",
                f"the shared decode stream broke: {lost.code}: {lost.details}",
                self.peer,
            )
        finally:
            if self._call is call:
                outbox, self._call, self._outbox = self._outbox, None, None
                if outbox is not None:
                    outbox.put_nowait(None)  # the writer's end
                call.cancel()
                self._fail_all(error)

    def _fail_all(self, error: PeerError) -> None:
        calls, self._calls = self._calls, {}
        for stream in calls.values():
            stream._deliver(error)
