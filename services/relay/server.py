"""relay's gRPC face: messages → ``pdd.serving.relay.Relay`` / the fast-link receiver → messages."""

from __future__ import annotations

import asyncio

import grpc

from pdd.gen.relay.v1 import relay_service_pb2 as pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as pb_grpc
from pdd.kv import messages as kv_convert
from pdd.kv.fast_link.rdma import RdmaReceiverBackend
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.kv.fast_link.select import probe_host
from pdd.kv.fast_link.shm import ShmReceiverBackend
from pdd.kv.fast_link.state import TransferState, Transport
from pdd.kv.fast_link.tcp import TcpReceiverBackend
from pdd.server.bootstrap import ServiceSpec
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.relay import Relay
from pdd.telemetry import metrics
from pdd.wire import relay as conv
from pdd.wire.common import cache_report_to_pb
from services.relay.config import RelayServiceConfig


class RelayServicer(pb_grpc.RelayServiceServicer):
    def __init__(self, instance: EngineInstance, relay: Relay, fast: FastLinkReceiver) -> None:
        self.instance = instance
        self.relay = relay
        self.fast = fast

    async def Decode(self, request: pb.DecodeRequest, context):
        job = conv.job_from_pb(request, self.instance.engine.model_config.vocab_size)
        async for ev in self.relay.decode(job):
            yield conv.event_to_pb(ev)

    async def PrepareTransfer(
        self, request: pb.PrepareTransferRequest, context
    ) -> pb.PrepareTransferResponse:
        return kv_convert.reservation_to_pb(
            await self.fast.prepare(kv_convert.prepare_request_from_pb(request))
        )

    async def PushKv(self, request_iterator, context) -> pb.PushKvResponse:
        received, chunks = await self.fast.receive_chunks(
            kv_convert.relay_push_items_from_pb(request_iterator)
        )
        return pb.PushKvResponse(bytes_received=received, chunks_received=chunks)

    async def CompleteTransfer(
        self, request: pb.CompleteTransferRequest, context
    ) -> pb.CompleteTransferResponse:
        state = await self.fast.complete(kv_convert.completion_from_pb(request))
        return pb.CompleteTransferResponse(accepted=state is TransferState.COMPLETED)

    async def DescribeCache(
        self, request: pb.DescribeCacheRequest, context
    ) -> pb.DescribeCacheResponse:
        report = await self.instance.describe(
            list(request.token_ids), request.cache_salt, request.request_id
        )
        return cache_report_to_pb(report, pb.DescribeCacheResponse)


def _backends(transports: str) -> list:
    wanted = (
        {t.strip() for t in transports.split(",")}
        if transports != "auto"
        else {"rdma", "shm", "tcp"}
    )
    backends = []
    if Transport.RDMA.value in wanted and probe_host().rdma_devices:
        backends.append(RdmaReceiverBackend())
    if Transport.SHM.value in wanted:
        backends.append(ShmReceiverBackend())
    if Transport.TCP.value in wanted:
        backends.append(TcpReceiverBackend())
    if not backends:
        raise ValueError(f"transports: none of {transports!r} is usable on this host")
    return backends


def build(config: RelayServiceConfig) -> ServiceSpec:
    instance = EngineInstance(config.instance, tls=config.server.tls, publish_cache_events=False)
    fast = FastLinkReceiver(_backends(config.transports), config.fast_link)
    metrics.FAST_LINK_REGIONS.set_function(lambda: fast.held_regions)
    channels = Channels(config.server.tls)
    relay = Relay(instance, fast, channels, config.relay, admission=config.instance.admission)
    servicer = RelayServicer(instance, relay, fast)
    sweeper: list[asyncio.Task] = []

    async def start() -> None:
        await instance.start()
        sweeper.append(asyncio.create_task(fast.run_sweeper()))

    async def stop() -> None:
        for t in sweeper:
            t.cancel()
        await instance.stop()
        await channels.close()
        fast.close()

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_RelayServiceServicer_to_server(servicer, server)

    return ServiceSpec(
        "relay",
        [pb.DESCRIPTOR.services_by_name["RelayService"].full_name],
        register,
        start=start,
        stop=stop,
        serving=instance.register,
    )
