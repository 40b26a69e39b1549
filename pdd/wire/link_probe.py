"""The WAN link's RTT probe: one ``grpc.health.v1`` check to a peer through the link's own path.

Prefill times it to a MainDecode of each remote cluster it pushes to (``pdd.kv.link_meter``):
the call is tiny, so its round trip is the link's delay plus whatever queueing the link's
shared bandwidth adds, not a push's size. Every PDD server answers health checks
(``pdd.server.bootstrap``).
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdd.core.errors import PeerError
from pdd.wire.call import unary


class LinkProbeClient:
    PEER = "main_decode"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)

    async def ping(self, timeout_s: float) -> float:
        """Seconds of one round trip; a ``PeerError`` (DEADLINE_EXCEEDED past ``timeout_s``)."""
        t0 = time.perf_counter()
        call = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        reply = await unary(self.PEER, call)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise PeerError("UNAVAILABLE", f"not serving ({reply.status})", self.PEER)
        return time.perf_counter() - t0
