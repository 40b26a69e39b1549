"""``wrap_handler``: every arity of a gRPC method runs inside the hook, which sees how it ended."""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc
import pytest

from pdd.server.handlers import wrap_handler

SERVICE = "test.handlers.v1.ArityService"


async def unary_unary(request: bytes, context) -> bytes:
    if request == b"boom":
        raise RuntimeError("boom")
    return request + b"!"


async def unary_stream(request: bytes, context):
    for i in range(int(request)):
        yield bytes([i])


async def stream_unary(requests, context) -> bytes:
    return b"".join([r async for r in requests])


async def stream_stream(requests, context):
    async for r in requests:
        if r == b"boom":
            raise RuntimeError("boom")
        yield r * 2


class Recording(grpc.aio.ServerInterceptor):
    """Wraps every method; records (method, what ended the call: None or the exception type)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, type | None]] = []

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method.rpartition("/")[2]

        @asynccontextmanager
        async def around(context):
            try:
                yield
            except BaseException as exc:
                self.calls.append((method, type(exc)))
                raise
            self.calls.append((method, None))

        return wrap_handler(handler, around)


@pytest.fixture
async def served():
    recording = Recording()
    server = grpc.aio.server(interceptors=[recording])
    ident = dict(request_deserializer=None, response_serializer=None)
    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary, **ident),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream, **ident),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary, **ident),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream, **ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, recording
    await server.stop(0)


async def test_every_arity_runs_inside_the_hook(served):
    ch, recording = served
    assert await ch.unary_unary(f"/{SERVICE}/UnaryUnary")(b"hi", timeout=5) == b"hi!"
    got = [r async for r in ch.unary_stream(f"/{SERVICE}/UnaryStream")(b"3", timeout=5)]
    assert got == [b"\x00", b"\x01", b"\x02"]
    assert await ch.stream_unary(f"/{SERVICE}/StreamUnary")(iter([b"a", b"b"]), timeout=5) == b"ab"
    call = ch.stream_stream(f"/{SERVICE}/StreamStream")(iter([b"x", b"y"]), timeout=5)
    assert [r async for r in call] == [b"xx", b"yy"]
    assert recording.calls == [
        ("UnaryUnary", None),
        ("UnaryStream", None),
        ("StreamUnary", None),
        ("StreamStream", None),
    ]


async def test_the_hook_sees_what_ended_a_failed_call(served):
    ch, recording = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ch.unary_unary(f"/{SERVICE}/UnaryUnary")(b"boom", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    call = ch.stream_stream(f"/{SERVICE}/StreamStream")(iter([b"x", b"boom"]), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        [r async for r in call]
    assert recording.calls == [("UnaryUnary", RuntimeError), ("StreamStream", RuntimeError)]
