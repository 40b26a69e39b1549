"""A WAN push through ``push_codec`` on both ends of a real gRPC call."""

from __future__ import annotations

import grpc

from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as mdgrpc
from pdd.kv import messages as convert
from pdd.kv import push_codec
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.receiver import KvReceiver, ReceiverConfig
from pdd.kv.source import BytesSource
from pdd.kv.transfer import Chunk, make_header
from pdd.kv.wan import KvPusher
from pdd.server.handlers import register_overriding


async def test_a_push_reaches_an_overriding_server_as_chunks_viewing_the_message():
    seen: list[object] = []
    receiver = KvReceiver(ReceiverConfig())

    class Servicer(mdgrpc.MainDecodeServiceServicer):
        async def PushKv(self, request_iterator, context):  # noqa: N802
            async def items():
                async for item in push_codec.push_items_from_wire(request_iterator):
                    seen.append(item)
                    yield item

            return convert.push_response_to_pb(await receiver.receive(items()))

    servicer = Servicer()
    server = grpc.aio.server()
    register_overriding(
        mdgrpc.add_MainDecodeServiceServicer_to_server,
        servicer,
        server,
        {"PushKv": push_codec.push_kv_handler(servicer.PushKv)},
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        header = make_header(
            "r", KvLayout(KvDtype.FLOAT32, 2, 2, 8), 0, 64, chunk_bytes=1024
        )  # 8 KiB in 8 chunks
        payload = bytes(range(256)) * (header.total_bytes // 256)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            report = await KvPusher.for_channel(channel).push(header, BytesSource(payload), [3])
        assert report.attempts == 1 and report.chunks_sent == header.num_chunks
        got = [x for x in seen if isinstance(x, Chunk)]
        assert len(got) == header.num_chunks and all(isinstance(c.data, memoryview) for c in got)
        kv = receiver.pop("r")
        assert kv is not None and bytes(kv.payload) == payload and kv.output_token_ids == (3,)
    finally:
        await server.stop(None)
