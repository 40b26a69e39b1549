"""The fast link's TCP transport over a real gRPC RelayService on port 0.

The servicer is the thin one a relay server will have: PrepareTransfer,
PushKv and CompleteTransfer convert and delegate to ``FastLinkReceiver``.
"""

from __future__ import annotations

import os

import grpc
import pytest

from pdd.core.errors import PddError, UnavailableError
from pdd.gen.relay.v1 import relay_service_pb2 as rpb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as rgrpc
from pdd.kv import messages as convert
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.kv.fast_link.region import Completion, PrepareRequest
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import ShmReceiverBackend
from pdd.kv.fast_link.state import TransferState, Transport
from pdd.kv.fast_link.tcp import TcpReceiverBackend, TcpSenderBackend
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.source import BytesSource
from pdd.kv.transfer import Chunk, make_header
from pdd.server.errors import status_for

LAYOUT = KvLayout(KvDtype.BFLOAT16, num_layers=4, num_kv_heads=2, head_dim=64)  # 2 KiB per token


class RelayServicer(rgrpc.RelayServiceServicer):
    def __init__(self, fast: FastLinkReceiver) -> None:
        self.fast = fast
        self.drop_chunk: int | None = None  # lose this chunk index in flight

    async def _items(self, requests):
        async for transfer_id, item in convert.relay_push_items_from_pb(requests):
            if isinstance(item, Chunk) and item.index == self.drop_chunk:
                continue  # lost in flight (test hook)
            yield transfer_id, item

    async def PrepareTransfer(self, request, context):
        try:
            return convert.reservation_to_pb(
                await self.fast.prepare(convert.prepare_request_from_pb(request))
            )
        except PddError as e:
            await context.abort(*status_for(e))

    async def PushKv(self, request_iterator, context):
        try:
            received, chunks = await self.fast.receive_chunks(self._items(request_iterator))
        except PddError as e:
            await context.abort(*status_for(e))
        return rpb.PushKvResponse(bytes_received=received, chunks_received=chunks)

    async def CompleteTransfer(self, request, context):
        state = await self.fast.complete(convert.completion_from_pb(request))
        return rpb.CompleteTransferResponse(accepted=state is TransferState.COMPLETED)


@pytest.fixture
async def relay():
    servicer = RelayServicer(FastLinkReceiver([ShmReceiverBackend(), TcpReceiverBackend()]))
    server = grpc.aio.server()
    rgrpc.add_RelayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, rgrpc.RelayServiceStub(channel)
    await channel.close()
    await server.stop(None)


async def _prepare(stub, rid: str, num_tokens: int):
    request = PrepareRequest(rid, LAYOUT, num_tokens, LAYOUT.nbytes(num_tokens), (Transport.TCP,))
    return convert.reservation_from_pb(
        await stub.PrepareTransfer(convert.prepare_request_to_pb(request)), request
    )


async def _send(stub, reservation, payload: bytes, num_tokens: int):
    async def complete(c):
        return (await stub.CompleteTransfer(convert.completion_to_pb(c))).accepted

    header = make_header(reservation.request_id, LAYOUT, 0, num_tokens, chunk_bytes=64 << 10)
    sender = FastLinkSender([TcpSenderBackend.for_stub(stub)])
    return await sender.send(reservation, header, BytesSource(payload), complete, [3])


async def test_tcp_fast_link_round_trip(relay):
    servicer, stub = relay
    payload = os.urandom(LAYOUT.nbytes(500))  # 1 MB, 16 chunks
    reservation = await _prepare(stub, "r", 500)
    report = await _send(stub, reservation, payload, 500)
    assert reservation.transport is Transport.TCP and report.state is TransferState.COMPLETED
    got = await servicer.fast.wait_complete("r", 5)
    assert (
        bytes(got.view) == payload
        and got.output_token_ids == (3,)
        and got.transport is Transport.TCP
    )


async def test_a_chunk_lost_on_tcp_is_caught_before_decoding(relay):
    servicer, stub = relay
    servicer.drop_chunk = 7
    reservation = await _prepare(stub, "r", 500)
    with pytest.raises(UnavailableError, match="received 15 of 16 chunks"):
        await _send(stub, reservation, os.urandom(LAYOUT.nbytes(500)), 500)
    # The sender saw the shortfall; the relay refuses the region if a completion comes anyway.
    header = make_header("r", LAYOUT, 0, 500, chunk_bytes=64 << 10)
    response = await stub.CompleteTransfer(
        convert.completion_to_pb(Completion(reservation.transfer_id, header, 0))
    )
    assert (
        not response.accepted
        and servicer.fast.state(reservation.transfer_id) is TransferState.FAILED
    )
