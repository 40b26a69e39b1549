"""The typed client of a relay instance: the gateway's ``decode``; prefill's fast-link calls
(``prepare_transfer`` → write the KV → ``complete_transfer``; ``tcp_backend`` where neither
RDMA nor shared memory reaches the relay)."""

from __future__ import annotations

import grpc

from pdd.core.stage_events import RelayEvent, RelayJob
from pdd.gen.relay.v1 import relay_service_pb2_grpc as pb_grpc
from pdd.kv import messages as kv_messages
from pdd.kv.fast_link.region import Completion, PrepareRequest, Reservation
from pdd.kv.fast_link.tcp import TcpSenderBackend
from pdd.server.interceptors import outgoing_metadata
from pdd.wire import relay as conv
from pdd.wire.call import EventStream, unary

PEER = "relay"


class RelayClient:
    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float | None = None) -> None:
        """``timeout_s``: the deadline of a whole ``decode`` call."""
        self._stub = pb_grpc.RelayServiceStub(channel)
        self.timeout_s = timeout_s

    def decode(self, job: RelayJob) -> EventStream[RelayEvent]:
        call = self._stub.Decode(
            conv.job_to_pb(job), metadata=outgoing_metadata(), timeout=self.timeout_s
        )
        return EventStream(PEER, call, conv.event_from_pb)

    async def prepare_transfer(self, request: PrepareRequest) -> Reservation:
        msg = kv_messages.prepare_request_to_pb(request)
        resp = await unary(PEER, self._stub.PrepareTransfer(msg, metadata=outgoing_metadata()))
        return kv_messages.reservation_from_pb(resp, request)

    async def complete_transfer(self, completion: Completion) -> bool:
        """Whether the relay accepted the written KV (checksums, sizes)."""
        msg = kv_messages.completion_to_pb(completion)
        resp = await unary(PEER, self._stub.CompleteTransfer(msg, metadata=outgoing_metadata()))
        return resp.accepted

    def tcp_backend(self) -> TcpSenderBackend:
        return TcpSenderBackend.for_stub(self._stub, metadata=outgoing_metadata())
