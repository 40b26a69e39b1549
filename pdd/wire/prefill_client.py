"""The typed client of a prefill instance (the gateway's)."""

from __future__ import annotations

import grpc

from pdd.core.stage_events import PrefillEvent, PrefillJob
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as pb_grpc
from pdd.server.interceptors import outgoing_metadata
from pdd.wire import prefill as conv
from pdd.wire.call import EventStream, unary

PEER = "prefill"
# NOTE: a local call beside a live Prefill call: seconds mean the prefill instance is stuck.
BIND_TIMEOUT_S = 5.0


class PrefillClient:
    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float | None = None) -> None:
        """``timeout_s``: the deadline of a whole ``prefill`` call."""
        self._stub = pb_grpc.PrefillServiceStub(channel)
        self.timeout_s = timeout_s

    def prefill(self, job: PrefillJob) -> EventStream[PrefillEvent]:
        call = self._stub.Prefill(
            conv.job_to_pb(job), metadata=outgoing_metadata(), timeout=self.timeout_s
        )
        return EventStream(PEER, call, conv.event_from_pb)

    async def bind_main_decode(self, request_id: str, main_decode_cached_tokens: int) -> None:
        """MainDecode accepted ``request_id`` holding that many prompt tokens: the WAN push of a
        prefill opened without the count starts there."""
        await unary(
            PEER,
            self._stub.BindMainDecode(
                conv.bind_to_pb(request_id, main_decode_cached_tokens),
                metadata=outgoing_metadata(),
                timeout=BIND_TIMEOUT_S,
            ),
        )
