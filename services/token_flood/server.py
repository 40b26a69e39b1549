"""The token-flood stage's gRPC face: a MainDecode that streams tokens as fast as it can.

``pdd bench gateway`` measures the gateway's own CPU per streamed token; a real engine on these
cores cannot produce tokens fast enough to load a gateway core, so this stage stands in for
MainDecode: it registers with kvstore as one, accepts a pipeline-MD ``Decode`` (or a call on a ``DecodeMany`` stream) and
answers ``Accepted``, then the request's ``max_tokens`` tokens ``tokens_per_message`` at a time,
each as soon as every other running request had its turn, then ``Finished``. Everything else MainDecode
serves is refused (UNIMPLEMENTED): the gateway's P-MD and relay paths are not what it loads.
Token ids are a fixed function of the position, so a client can check what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import Accepted, DecodeEvent, DecodeJob, Finished, Tokens
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import ServiceSpec
from pdd.testbed.flood_tokens import token_at
from pdd.wire import main_decode as conv
from pdd.wire.decode_many import DecodeManyStreams
from pdd.wire.kvstore_client import KvstoreClient
from services.token_flood.config import TokenFloodConfig

log = structlog.get_logger(__name__)

HEARTBEAT_S = 1.0
TTL_MS = 10_000


class TokenFloodServicer(pb_grpc.MainDecodeServiceServicer):
    def __init__(self, config: TokenFloodConfig) -> None:
        self.config = config
        self.running = 0
        self.many = DecodeManyStreams(self.events, lambda: config.vocab_size, config.instance_id)

    async def events(self, job: DecodeJob) -> AsyncIterator[DecodeEvent]:
        """A request's events: ``tokens_per_message`` tokens a step, every running request's
        step taken before the next (what an engine step makes for a batch)."""
        cfg = self.config
        if job.pipeline is not Pipeline.MD:
            raise InvalidArgumentError(
                "pipeline", f"the token flood serves pipeline MD only, got {job.pipeline.value}"
            )
        n, k = job.sampling.max_tokens, cfg.tokens_per_message
        self.running += 1
        try:
            yield Accepted(0)
            for start in range(0, n, k):
                ids = tuple(token_at(p, cfg.vocab_size) for p in range(start, min(n, start + k)))
                yield Tokens(start, ids)
                await asyncio.sleep(0)  # NOTE: the other requests' step
            yield Finished("length", n, n)
        finally:
            self.running -= 1

    async def Decode(self, request, context):
        job = conv.job_from_pb(request, self.config.vocab_size)
        async for ev in self.events(job):
            yield conv.event_to_pb(ev, self.config.instance_id)

    async def DecodeMany(self, request_iterator, context):
        async for msg in self.many.serve(request_iterator):
            yield msg


class Membership:
    """Registered with kvstore as a MainDecode while serving; a heartbeat keeps the lease."""

    def __init__(self, config: TokenFloodConfig, servicer: TokenFloodServicer) -> None:
        self.config, self.servicer = config, servicer
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None

    async def start(self, port: int) -> None:
        cfg = self.config
        self._channel = grpc.aio.insecure_channel(cfg.kvstore)
        client = KvstoreClient(self._channel)
        address = cfg.advertise or f"127.0.0.1:{port}"
        # NOTE: also listed as a prefill, never called: the router picks a prefill for every
        # route (a pipeline-MD request does not use it), so a stack without one refuses all.
        for instance_id, role in self._ids():
            ref = InstanceRef(instance_id, address, role, cfg.cluster)
            await client.register(Instance(ref, block_size=16), TTL_MS, reset_index=True)
        log.info("token_flood_registered", address=address, kvstore=cfg.kvstore)
        self._task = asyncio.create_task(self._beat(client))

    def _ids(self) -> tuple[tuple[str, Role], ...]:
        me = self.config.instance_id
        return ((me, Role.MAIN_DECODE), (f"{me}-prefill", Role.PREFILL))

    async def _beat(self, client: KvstoreClient) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            load = InstanceLoad(running_requests=self.servicer.running)
            try:
                for instance_id, _ in self._ids():
                    await client.heartbeat(instance_id, load)
            except Exception as exc:  # noqa: BLE001 — a missed beat is retried on the next
                log.warning("token_flood_heartbeat_failed", error=str(exc)[:200])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._channel is not None:
            # NOTE: leave at once: the next flood stage of a run must not share the routes.
            client = KvstoreClient(self._channel)
            for instance_id, _ in self._ids():
                with contextlib.suppress(Exception):
                    await client.deregister(instance_id, timeout_s=2)
            await self._channel.close()


def build(config: TokenFloodConfig) -> ServiceSpec:
    servicer = TokenFloodServicer(config)
    membership = Membership(config, servicer)
    return ServiceSpec(
        name="token_flood",
        grpc_services=("pdd.main_decode.v1.MainDecodeService",),
        register=lambda server: pb_grpc.add_MainDecodeServiceServicer_to_server(servicer, server),
        stop=membership.stop,
        serving=membership.start,
        draining=servicer.many.drain,
    )
