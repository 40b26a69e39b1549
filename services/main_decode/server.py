"""main_decode's gRPC face: messages → ``pdd.serving.main_decode.MainDecode`` → messages."""

from __future__ import annotations

import grpc

from pdd.gen.main_decode.v1 import main_decode_service_pb2 as pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
from pdd.kv import messages as kv_convert
from pdd.kv import push_codec
from pdd.kv.receiver import KvReceiver
from pdd.server.bootstrap import ServiceSpec
from pdd.server.handlers import register_overriding
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.main_decode import MainDecode
from pdd.wire import main_decode as conv
from pdd.wire.common import cache_report_to_pb
from pdd.wire.decode_many import DecodeManyStreams
from services.main_decode.config import MainDecodeConfig


class MainDecodeServicer(pb_grpc.MainDecodeServiceServicer):
    def __init__(self, instance: EngineInstance, md: MainDecode, receiver: KvReceiver) -> None:
        self.instance = instance
        self.md = md
        self.receiver = receiver
        self.many = DecodeManyStreams(
            md.decode, lambda: self.vocab, instance.config.ref.instance_id
        )

    @property
    def vocab(self) -> int:
        return self.instance.engine.model_config.vocab_size

    async def Decode(self, request: pb.DecodeRequest, context):
        job = conv.job_from_pb(request, self.vocab)
        async for ev in self.md.decode(job):
            yield conv.event_to_pb(ev, self.instance.config.ref.instance_id)

    async def DecodeMany(self, request_iterator, context):
        async for msg in self.many.serve(request_iterator):
            yield msg

    async def PushKv(self, request_iterator, context) -> pb.PushKvResponse:
        # NOTE: requests read by push_codec.PushKvDecoder (see register): chunks arrive as Chunk.
        status = await self.receiver.receive(push_codec.push_items_from_wire(request_iterator))
        return kv_convert.push_response_to_pb(status)

    async def GetKvTransfer(
        self, request: pb.GetKvTransferRequest, context
    ) -> pb.GetKvTransferResponse:
        return kv_convert.transfer_status_to_pb(self.receiver.status(request.request_id))

    async def WaitKvReady(self, request: pb.WaitKvReadyRequest, context) -> pb.WaitKvReadyResponse:
        readiness = await self.md.wait_kv_ready(request.request_id, request.timeout_ms or 30_000)
        return conv.kv_readiness_to_pb(readiness)

    async def TokenHandoff(self, request_iterator, context):
        index, request_id = 0, ""
        async for msg in request_iterator:
            batch = conv.handoff_batch_from_pb(msg, index, self.vocab, request_id)
            request_id = batch.request_id
            ack = await self.md.handoff(batch)
            index += 1
            yield conv.handoff_ack_to_pb(ack)

    async def DescribeCache(
        self, request: pb.DescribeCacheRequest, context
    ) -> pb.DescribeCacheResponse:
        report = await self.instance.describe(
            list(request.token_ids), request.cache_salt, request.request_id
        )
        return cache_report_to_pb(report, pb.DescribeCacheResponse)


def register_servicer(servicer: MainDecodeServicer, server: grpc.aio.Server) -> None:
    """``servicer`` on ``server``, ``PushKv``'s requests read by ``push_codec`` (chunks without
    protobuf objects: the KV bytes not copied)."""
    register_overriding(
        pb_grpc.add_MainDecodeServiceServicer_to_server,
        servicer,
        server,
        {"PushKv": push_codec.push_kv_handler(servicer.PushKv)},
    )


def build(config: MainDecodeConfig) -> ServiceSpec:
    instance = EngineInstance(config.instance, tls=config.server.tls)
    receiver = KvReceiver(config.receiver)
    md = MainDecode(
        instance,
        receiver,
        kv_timeout_s=config.kv_timeout_s,
        admission=config.instance.admission,
    )
    servicer = MainDecodeServicer(instance, md, receiver)

    def register(server: grpc.aio.Server) -> None:
        register_servicer(servicer, server)

    return ServiceSpec(
        "main_decode",
        [pb.DESCRIPTOR.services_by_name["MainDecodeService"].full_name],
        register,
        start=instance.start,
        stop=instance.stop,
        serving=instance.register,
        draining=servicer.many.drain,
    )
