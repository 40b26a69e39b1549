"""The typed client of a relay instance (the gateway's ``decode``; prefill's fast-link calls are
``pdd.wire.kv_clients.FastLinkClient``)."""

from __future__ import annotations

import grpc

from pdd.core.stage_events import RelayEvent, RelayJob
from pdd.gen.relay.v1 import relay_service_pb2_grpc as pb_grpc
from pdd.server.interceptors import outgoing_metadata
from pdd.wire import relay as conv
from pdd.wire.call import EventStream

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
