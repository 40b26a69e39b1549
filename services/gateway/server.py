"""The gateway's faces: gRPC (GenerateRequest → GenerateJob → Gateway → deltas) and,
when ``http.port`` is set, the OpenAI-compatible HTTP API (``pdd.http``) in the same
event loop, started once the gRPC server serves and announced with one line
``PDD_HTTP_LISTENING gateway <host:port>`` on stdout.

The request life is in ``pdd.serving.gateway``; this module only converts.
"""

from __future__ import annotations

import random

import grpc
import structlog

from pdd.core.model_info import ModelInfo
from pdd.core.request import TokenEvent
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.http.openai_api import OpenAIServer
from pdd.server.bootstrap import ServiceSpec
from pdd.serving.detokenizer import Detokenizer
from pdd.serving.gateway import Gateway
from pdd.serving.model_info import load_model_info
from pdd.wire.gateway import event_to_pb, generate_from_pb, model_info_to_pb
from services.gateway.config import GatewayConfig


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway, info: ModelInfo, decode) -> None:
        self.gateway = gateway
        self.info = info
        self.decode = decode

    async def Generate(self, request: pb.GenerateRequest, context):
        job = generate_from_pb(request, self.info)
        # NOTE: the request's own id, not the interceptor's, is what every hop logs and forwards.
        structlog.contextvars.bind_contextvars(request_id=job.request_id)
        detok = Detokenizer(self.decode)
        async for ev in self.gateway.generate(job, deadline_s=context.time_remaining()):
            text = detok.add(ev.token_ids) if isinstance(ev, TokenEvent) else ""
            yield event_to_pb(ev, job.request_id, text)

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return model_info_to_pb(self.info)


def build(config: GatewayConfig) -> ServiceSpec:
    info, decode = load_model_info(config.model)
    gateway = Gateway(
        config.kvstore_address,
        config.routing,
        random.Random(config.seed) if config.seed is not None else random.Random(),
        config.stage_timeout_s,
        tls=config.server.tls,
        index_timeout_s=config.index_timeout_s,
        max_migrations=config.max_migrations,
        eos_token_ids=info.eos_token_ids,
        kv_deadline_s=config.kv_deadline_s,
        max_in_flight=config.max_in_flight,
        adaptive_in_flight=config.adaptive_in_flight,
        admission_wait_s=config.admission_wait_s,
        kv_bytes_per_token=config.kv_bytes_per_token(info),
        shared_decode_stream=config.shared_decode_stream,
    )
    servicer = GatewayServicer(gateway, info, decode)
    http = OpenAIServer(gateway, info, decode, config.http) if config.http.port else None

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_GatewayServiceServicer_to_server(servicer, server)

    async def serving(port: int) -> None:
        gateway.view.start_refreshing()  # the last known instances, kept fresh while idle
        if http is not None:
            print(f"PDD_HTTP_LISTENING gateway {await http.start()}", flush=True)

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await gateway.close()

    return ServiceSpec(
        "gateway",
        [pb.DESCRIPTOR.services_by_name["GatewayService"].full_name],
        register,
        stop=stop,
        serving=serving,
    )
