"""Bytes that do not parse as the request message: INVALID_ARGUMENT naming ``request``, through
the same interceptors every service runs — not grpc's UNKNOWN — for unary and streamed requests;
the servicer never sees them, and the server answers the next good call."""

from __future__ import annotations

import grpc
import pytest

from pdd.gen.gateway.v1 import gateway_service_pb2 as g_pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as g_grpc
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.server.interceptors import ContextInterceptor
from pdd.server.telemetry_interceptor import TelemetryInterceptor

CORRUPT = b"\xca"  # a tag whose field never ends


class Gateway(g_grpc.GatewayServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def GetModelInfo(self, request, context):
        self.calls += 1
        return g_pb.GetModelInfoResponse(model="m")


class MainDecode(md_grpc.MainDecodeServiceServicer):
    def __init__(self) -> None:
        self.seen: list = []

    async def TokenHandoff(self, request_iterator, context):
        async for msg in request_iterator:
            self.seen.append(msg)
            yield md_pb.TokenHandoffResponse()


@pytest.fixture
async def server():
    srv = grpc.aio.server(interceptors=[TelemetryInterceptor(), ContextInterceptor()])
    gw, md = Gateway(), MainDecode()
    g_grpc.add_GatewayServiceServicer_to_server(gw, srv)
    md_grpc.add_MainDecodeServiceServicer_to_server(md, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel, gw, md
    await channel.close()
    await srv.stop(0)


async def test_a_unary_request_that_does_not_parse_is_invalid_argument(server):
    channel, gw, _ = server
    raw = channel.unary_unary(
        "/pdd.gateway.v1.GatewayService/GetModelInfo",
        request_serializer=None,
        response_deserializer=None,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(CORRUPT, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request: is not a valid pdd.gateway.v1.")
    assert gw.calls == 0
    assert (await raw(b"", timeout=5)) == g_pb.GetModelInfoResponse(model="m").SerializeToString()
    assert gw.calls == 1


async def test_a_streamed_request_that_does_not_parse_is_invalid_argument(server):
    channel, _, md = server
    raw = channel.stream_stream(
        "/pdd.main_decode.v1.MainDecodeService/TokenHandoff",
        request_serializer=None,
        response_deserializer=None,
    )
    good = md_pb.TokenHandoffRequest(request_id="r").SerializeToString()

    async def requests():
        yield good
        yield CORRUPT

    call = raw(requests(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request: is not a valid" in err.value.details()
    assert [m.request_id for m in md.seen] == ["r"]  # the good one came through, the bad one not
