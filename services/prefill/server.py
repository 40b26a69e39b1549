"""prefill's gRPC face: messages → ``pdd.serving.prefill.Prefill`` → messages."""

from __future__ import annotations

import grpc

from pdd.gen.prefill.v1 import prefill_service_pb2 as pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import ServiceSpec
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.prefill import Prefill
from pdd.wire import prefill as conv
from pdd.wire.common import cache_report_to_pb
from services.prefill.config import PrefillServiceConfig


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, instance: EngineInstance, prefill: Prefill) -> None:
        self.instance = instance
        self.prefill = prefill

    async def Prefill(self, request: pb.PrefillRequest, context):
        job = conv.job_from_pb(request, self.instance.engine.model_config.vocab_size)
        async for ev in self.prefill.prefill(job):
            yield conv.event_to_pb(ev)

    async def BindMainDecode(
        self, request: pb.BindMainDecodeRequest, context
    ) -> pb.BindMainDecodeResponse:
        self.prefill.bind(*conv.bind_from_pb(request))
        return pb.BindMainDecodeResponse()

    async def DescribeCache(
        self, request: pb.DescribeCacheRequest, context
    ) -> pb.DescribeCacheResponse:
        report = await self.instance.describe(
            list(request.token_ids), request.cache_salt, request.request_id
        )
        return cache_report_to_pb(report, pb.DescribeCacheResponse)


def build(config: PrefillServiceConfig) -> ServiceSpec:
    instance = EngineInstance(config.instance, tls=config.server.tls)
    channels = Channels(config.server.tls)
    prefill = Prefill(instance, channels, config.prefill, admission=config.instance.admission)
    servicer = PrefillServicer(instance, prefill)

    async def stop() -> None:
        await prefill.close()
        await instance.stop()
        await channels.close()

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)

    return ServiceSpec(
        "prefill",
        [pb.DESCRIPTOR.services_by_name["PrefillService"].full_name],
        register,
        start=instance.start,
        stop=stop,
        serving=instance.register,
    )
