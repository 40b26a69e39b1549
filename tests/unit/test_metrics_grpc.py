"""Every service's gRPC calls are counted by method and final status code (loopback server)."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import REGISTRY

from pdd.core.errors import InvalidArgumentError
from pdd.server.bootstrap import GrpcServer, ServiceSpec
from pdd.server.config import ServerConfig

SERVICE = "test.telemetry.v1.EchoService"


async def echo(request: bytes, context) -> bytes:
    if request == b"bad":
        raise InvalidArgumentError("payload", "must not be 'bad'")
    if request == b"boom":
        raise RuntimeError("boom")
    return request


async def count(request: bytes, context):
    for i in range(int(request)):
        yield bytes([i])


def register(server: grpc.aio.Server) -> None:
    ident = dict(request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(echo, **ident),
                    "Count": grpc.unary_stream_rpc_method_handler(count, **ident),
                },
            ),
        )
    )


def handled(method: str, code: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "pdd_grpc_server_handled_total",
            dict(grpc_service=SERVICE, grpc_method=method, grpc_code=code),
        )
        or 0.0
    )


@pytest.fixture
async def server():
    s = GrpcServer(ServerConfig(port=0, grace_s=0), ServiceSpec("echo", [SERVICE], register))
    await s.start()
    yield s
    await s.stop()


async def test_calls_are_counted_with_their_final_code(server):
    before = {
        k: handled(*k)
        for k in [
            ("Echo", "OK"),
            ("Echo", "INVALID_ARGUMENT"),
            ("Echo", "INTERNAL"),
            ("Count", "OK"),
        ]
    }
    durations = (
        REGISTRY.get_sample_value(
            "pdd_grpc_server_handling_seconds_count", dict(grpc_service=SERVICE, grpc_method="Echo")
        )
        or 0.0
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        unary = ch.unary_unary(f"/{SERVICE}/Echo")
        assert await unary(b"hi", metadata=(("x-request-id", "r-1"),)) == b"hi"
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await unary(b"bad")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as boom:
            await unary(b"boom")
        assert boom.value.code() == grpc.StatusCode.INTERNAL
        assert [m async for m in ch.unary_stream(f"/{SERVICE}/Count")(b"3")] == [
            b"\x00",
            b"\x01",
            b"\x02",
        ]
    assert handled("Echo", "OK") == before[("Echo", "OK")] + 1
    assert handled("Echo", "INVALID_ARGUMENT") == before[("Echo", "INVALID_ARGUMENT")] + 1
    assert handled("Echo", "INTERNAL") == before[("Echo", "INTERNAL")] + 1
    assert handled("Count", "OK") == before[("Count", "OK")] + 1
    assert (
        REGISTRY.get_sample_value(
            "pdd_grpc_server_handling_seconds_count", dict(grpc_service=SERVICE, grpc_method="Echo")
        )
        == durations + 3
    )
