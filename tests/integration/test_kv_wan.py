"""WAN KV pushes over a real gRPC server on port 0: resends, resumes, the stream pool.

The servicer here is the thin one a MainDecode server will have (proto →
``KvReceiver`` → proto), plus test hooks that play the network's faults: flip
a byte of one chunk, or abort the first stream after n chunks.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from pdd.core.errors import PddError, ResourceExhaustedError
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as mdgrpc
from pdd.kv import messages as convert
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.push_codec import push_kv_call
from pdd.kv.receiver import KvReceiver, ReceivedKv, ReceiverConfig
from pdd.kv.source import BytesSource
from pdd.kv.transfer import Chunk, Compression, make_header
from pdd.kv.wan import KvPusher, PusherConfig, StreamPool
from pdd.server.errors import status_for
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator

LAYOUT = KvLayout(KvDtype.BFLOAT16, num_layers=4, num_kv_heads=2, head_dim=64)  # 2 KiB per token
FAST = PusherConfig(backoff_s=0.0, backoff_max_s=0.0)


class PushServicer(mdgrpc.MainDecodeServiceServicer):
    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver
        self.corrupt_once: set[int] = set()  # chunk indices to damage the first time they pass
        self.abort_first_stream_after: int | None = None
        self.streams: list[list[int]] = []  # chunk indices each stream carried to the receiver
        self.gate: asyncio.Event | None = None  # when set, each stream holds here before finishing
        self.active = 0
        self.max_active = 0
        self.saw_two = asyncio.Event()
        self.five_chunks_in = asyncio.Event()  # the first stream delivered 5 chunks
        self.address = ""

    async def _items(self, requests, seen: list[int], context):
        async for item in convert.push_items_from_pb(requests):
            if isinstance(item, Chunk):
                if (
                    self.abort_first_stream_after is not None
                    and len(self.streams) == 1
                    and len(seen) == self.abort_first_stream_after
                ):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "link dropped (test)")
                if item.index in self.corrupt_once:
                    self.corrupt_once.discard(item.index)
                    item = Chunk(
                        item.request_id,
                        item.index,
                        item.offset,
                        bytes([item.data[0] ^ 0xFF]) + item.data[1:],
                        item.crc32,
                    )
                seen.append(item.index)
                if len(self.streams) == 1 and len(seen) == 5:
                    self.five_chunks_in.set()
            yield item

    async def PushKv(self, request_iterator, context):
        seen: list[int] = []
        self.streams.append(seen)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        if self.active >= 2:
            self.saw_two.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            status = await self.receiver.receive(self._items(request_iterator, seen, context))
        except PddError as e:
            await context.abort(*status_for(e))
        finally:
            self.active -= 1
        return convert.push_response_to_pb(status)

    async def GetKvTransfer(self, request, context):
        return convert.transfer_status_to_pb(self.receiver.status(request.request_id))


@pytest.fixture
async def md():
    delivered: list[ReceivedKv] = []
    receiver = KvReceiver(ReceiverConfig(max_transfer_bytes=64 << 20), on_complete=delivered.append)
    servicer = PushServicer(receiver)
    server = grpc.aio.server()
    mdgrpc.add_MainDecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel, delivered
    await channel.close()
    await server.stop(None)


def _transfer(request_id: str, num_tokens: int = 200, chunk_bytes: int = 32 << 10, **kw):
    payload = os.urandom(LAYOUT.nbytes(num_tokens))
    return make_header(request_id, LAYOUT, 0, num_tokens, chunk_bytes=chunk_bytes, **kw), payload


@pytest.mark.parametrize("compression", list(Compression))
async def test_push_delivers_the_payload_once(md, compression):
    servicer, channel, delivered = md
    header, payload = _transfer("r1", compression=compression)
    report = await KvPusher.for_channel(channel, config=FAST).push(
        header, BytesSource(payload), [17]
    )
    assert (report.attempts, report.chunks_sent, report.chunks_resent) == (1, header.num_chunks, 0)
    [got] = delivered
    assert bytes(got.payload) == payload and got.output_token_ids == (17,) and got.header == header
    assert (await servicer.receiver.wait_complete("r1", 1.0)) is got


async def test_corrupted_chunk_is_resent_and_the_payload_delivered_once(md):
    servicer, channel, delivered = md
    header, payload = _transfer("r2")
    servicer.corrupt_once = {5}
    report = await KvPusher.for_channel(channel, config=FAST).push(header, BytesSource(payload))
    assert (report.attempts, report.chunks_resent) == (2, 1)
    assert servicer.streams[1] == [5]
    assert len(delivered) == 1 and bytes(delivered[0].payload) == payload


async def test_server_abort_mid_stream_resumes_with_only_the_missing_chunks(md):
    servicer, channel, delivered = md
    header, payload = _transfer("r3")
    servicer.abort_first_stream_after = 4
    report = await KvPusher.for_channel(channel, config=FAST).push(header, BytesSource(payload))
    assert report.attempts == 2
    assert servicer.streams[0] == [0, 1, 2, 3]
    assert servicer.streams[1] == list(range(4, header.num_chunks))
    assert len(delivered) == 1 and bytes(delivered[0].payload) == payload


async def test_client_cancel_mid_stream_resumes_and_delivers_once(md):
    servicer, channel, delivered = md
    header, payload = _transfer("r4")
    calls = []

    def push(requests):
        async def counted():
            n = 0
            async for msg in requests:
                yield msg
                n += isinstance(msg, Chunk)
                if len(calls) == 1 and n == 6:
                    calls[0].cancel()  # the client gives up on the first stream mid-way
                    return

        calls.append(push_kv_call(channel)(counted()))
        return calls[-1]

    async def get_transfer(rid):
        return await mdgrpc.MainDecodeServiceStub(channel).GetKvTransfer(
            mdpb.GetKvTransferRequest(request_id=rid)
        )

    report = await KvPusher(push, get_transfer, config=FAST).push(header, BytesSource(payload))
    assert report.attempts == 2 and len(calls) == 2
    # The second stream carried what the receiver lacked, nothing it already had.
    assert set(servicer.streams[1]).isdisjoint(servicer.streams[0])
    assert sorted(servicer.streams[0] + servicer.streams[1]) == list(range(header.num_chunks))
    assert len(delivered) == 1 and bytes(delivered[0].payload) == payload


async def test_pool_caps_concurrent_streams_and_queues_fifo(md):
    servicer, channel, delivered = md
    servicer.gate = asyncio.Event()
    pool = StreamPool(2)
    pusher = KvPusher.for_channel(channel, config=FAST, pool=pool)
    transfers = [_transfer(f"p{i}", num_tokens=20) for i in range(6)]
    tasks = [asyncio.create_task(pusher.push(h, BytesSource(p))) for h, p in transfers]
    await asyncio.wait_for(servicer.saw_two.wait(), 10)
    assert pool.in_use == 2 and pool.waiting == 4
    servicer.gate.set()
    reports = await asyncio.gather(*tasks)
    assert servicer.max_active == 2 and pool.peak_in_use == 2
    # FIFO: queued together, the pushes got their slots one after another in the order they asked.
    waits = [r.queue_wait_s for r in reports[2:]]
    assert all(w > 0 for w in waits) and waits == sorted(waits)
    assert {d.header.request_id: bytes(d.payload) for d in delivered} == {
        h.request_id: p for h, p in transfers
    }


async def test_non_retryable_rejection_is_a_domain_error_without_retry(md):
    servicer, channel, delivered = md
    header, payload = _transfer(
        "big", num_tokens=40_000, chunk_bytes=1 << 20
    )  # 80 MiB > the 64 MiB limit
    with pytest.raises(ResourceExhaustedError, match="exceeds the limit"):
        await KvPusher.for_channel(channel, config=FAST).push(header, BytesSource(payload))
    # NOTE: when the abort races the client's writes, grpc.aio may report it as a local
    # cancellation first (a broken stream); the pusher then resumes once and gets the real status.
    assert (
        len(servicer.streams) in (1, 2)
        and all(s == [] for s in servicer.streams)
        and delivered == []
    )


async def test_waiter_before_the_header_wakes_on_delivery(md):
    servicer, channel, delivered = md
    header, payload = _transfer("early")
    waiter = asyncio.create_task(servicer.receiver.wait_complete("early", 10))
    await KvPusher.for_channel(channel, config=FAST).push(header, BytesSource(payload))
    got = await waiter
    assert bytes(got.payload) == payload and delivered == [got]


async def test_push_through_the_wan_emulator_survives_a_connection_reset(md):
    servicer, _, delivered = md
    header, payload = _transfer("wan", num_tokens=600)  # 1.2 MB: ~0.12 s at 80 Mbit/s
    async with LinkEmulator(LinkConfig(mbps=80, delay_ms=5), servicer.address) as em:
        async with grpc.aio.insecure_channel(em.address) as channel:
            pusher = KvPusher.for_channel(channel, config=FAST)
            push = asyncio.create_task(pusher.push(header, BytesSource(payload)))
            await asyncio.wait_for(servicer.five_chunks_in.wait(), 10)
            assert em.reset_connections() == 1
            report = await push
    assert report.attempts == 2 and em.stats().connections_total == 2
    assert len(delivered) == 1 and bytes(delivered[0].payload) == payload
    assert servicer.receiver.status("wan").complete
