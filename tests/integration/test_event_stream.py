"""``EventStream`` over a real gRPC call: a read pending when the caller cancels the call ends
as a CANCELLED ``PeerError`` (grpc.aio itself raises CancelledError there), so a reader task
tells "we stopped this call" from "the task was cancelled" — the gateway's stage readers post
the stage's end on the first and must not die silently."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdd.core.errors import PeerError
from pdd.wire.call import EventStream

METHOD = "/pdd.test.v1.HoldService/Hold"


async def _hold(request: bytes, context) -> object:
    yield b"first"
    await asyncio.Event().wait()  # NOTE: never ends on its own


@pytest.fixture
async def channel():
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "pdd.test.v1.HoldService",
        {"Hold": grpc.unary_stream_rpc_method_handler(_hold)},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    await server.stop(0)


def _stream(channel) -> EventStream:
    call = channel.unary_stream(METHOD)(b"")
    return EventStream("hold", call, bytes)


async def test_a_pending_read_of_a_cancelled_call_is_a_cancelled_peer_error(channel):
    stream = _stream(channel)
    assert await stream.read() == b"first"
    pending = asyncio.create_task(stream.read())
    await asyncio.sleep(0.2)
    stream.cancel()
    with pytest.raises(PeerError) as err:
        await asyncio.wait_for(pending, 5)
    assert err.value.cancelled and err.value.peer == "hold"


async def test_cancelling_the_reading_task_still_cancels_the_task(channel):
    stream = _stream(channel)
    assert await stream.read() == b"first"
    pending = asyncio.create_task(stream.read())
    await asyncio.sleep(0.2)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    stream.cancel()
