"""The typed clients that move KV: prefill's WAN push to a MainDecode and its fast link to a relay.

Kept apart from ``main_decode_client`` and ``relay_client`` (which the gateway uses) because the
KV wire format needs torch, and the gateway process runs without it.
"""

from __future__ import annotations

import grpc

from pdd.gen.relay.v1 import relay_service_pb2_grpc as relay_grpc
from pdd.kv import messages as kv_messages
from pdd.kv.fast_link.region import Completion, PrepareRequest, Reservation
from pdd.kv.fast_link.tcp import TcpSenderBackend
from pdd.kv.stream_pool import StreamPool
from pdd.kv.wan import KvPusher, PusherConfig
from pdd.server.interceptors import outgoing_metadata
from pdd.wire.call import unary


class KvPushClient:
    """MainDecode's ``PushKv``/``GetKvTransfer``: the resumable WAN push of a KV delta."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def kv_pusher(self, pool: StreamPool, config: PusherConfig | None = None) -> KvPusher:
        """A pusher of KV ranges to this MainDecode, through ``pool``'s stream slots."""
        return KvPusher.for_channel(
            self._channel, config=config or PusherConfig(), pool=pool, metadata=outgoing_metadata()
        )


class FastLinkClient:
    """The relay's fast-link handshake: ``prepare_transfer`` → write the KV (shared memory, RDMA,
    or ``tcp_backend`` where neither reaches the relay) → ``complete_transfer``."""

    PEER = "relay"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = relay_grpc.RelayServiceStub(channel)

    async def prepare_transfer(self, request: PrepareRequest) -> Reservation:
        msg = kv_messages.prepare_request_to_pb(request)
        call = self._stub.PrepareTransfer(msg, metadata=outgoing_metadata())
        return kv_messages.reservation_from_pb(await unary(self.PEER, call), request)

    async def complete_transfer(self, completion: Completion) -> bool:
        """Whether the relay accepted the written KV (checksums, sizes)."""
        msg = kv_messages.completion_to_pb(completion)
        call = self._stub.CompleteTransfer(msg, metadata=outgoing_metadata())
        return (await unary(self.PEER, call)).accepted

    def tcp_backend(self) -> TcpSenderBackend:
        return TcpSenderBackend.for_stub(self._stub, metadata=outgoing_metadata())
