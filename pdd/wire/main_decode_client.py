"""The typed client of a MainDecode instance: domain objects in, domain objects out.

Used by the gateway (``decode``, and ``token_handoff`` when it drives a handoff itself) and the
relay (``wait_kv_ready``, ``token_handoff``); prefill's WAN push of a KV delta is
``pdd.wire.kv_clients.KvPushClient``. Every call forwards the current request id.
"""

from __future__ import annotations

import grpc

from pdd.core.stage_events import (
    DecodeEvent,
    DecodeJob,
    HandoffAck,
    HandoffBatch,
    KvReadiness,
)
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
from pdd.server.interceptors import outgoing_metadata
from pdd.wire import main_decode as conv
from pdd.wire.call import EventStream, HandoffCall, unary
from pdd.wire.decode_mux import DecodeMux, MuxStream

PEER = "main_decode"


class MainDecodeClient:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        timeout_s: float | None = None,
        mux: DecodeMux | None = None,
    ) -> None:
        """``timeout_s``: the deadline of a whole ``decode`` or ``token_handoff`` call.
        ``mux``: ``decode`` starts the request on this shared ``DecodeMany`` stream (the
        instance's tokens for many requests in one message) instead of a ``Decode`` call."""
        self._stub = pb_grpc.MainDecodeServiceStub(channel)
        self.timeout_s = timeout_s
        self.mux = mux

    def decode(self, job: DecodeJob) -> EventStream[DecodeEvent] | MuxStream:
        if self.mux is not None:
            return self.mux.open(job, self.timeout_s)
        call = self._stub.Decode(
            conv.job_to_pb(job), metadata=outgoing_metadata(), timeout=self.timeout_s
        )
        return EventStream(PEER, call, conv.event_from_pb)

    async def wait_kv_ready(self, request_id: str, timeout_ms: int) -> KvReadiness:
        """Long-poll (at most ``timeout_ms``) until MainDecode holds the request's KV."""
        request = pb.WaitKvReadyRequest(request_id=request_id, timeout_ms=timeout_ms)
        resp = await unary(PEER, self._stub.WaitKvReady(request, metadata=outgoing_metadata()))
        return conv.kv_readiness_from_pb(resp)

    def token_handoff(self) -> HandoffCall[HandoffBatch, HandoffAck]:
        call = self._stub.TokenHandoff(metadata=outgoing_metadata(), timeout=self.timeout_s)
        return HandoffCall(PEER, call, conv.handoff_batch_to_pb, conv.handoff_ack_from_pb)
