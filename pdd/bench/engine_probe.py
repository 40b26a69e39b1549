"""DescribeCache on every engine instance of a Stack, by its own address (never through the WAN).

Used by ``pdd chaos`` and the e2e tests to see which instance still holds a request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as p_grpc
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc
from pdd.testbed.stack import Stack


@dataclass
class EngineProbe:
    """DescribeCache on every engine instance, by its own address (never through the WAN)."""

    stack: Stack

    def _targets(self):
        for p in self.stack.processes:
            kind = p.name.split("-")[0]
            stub, req = {
                "prefill": (p_grpc.PrefillServiceStub, p_pb.DescribeCacheRequest),
                "relay": (r_grpc.RelayServiceStub, r_pb.DescribeCacheRequest),
                "main_decode": (md_grpc.MainDecodeServiceStub, md_pb.DescribeCacheRequest),
            }.get(kind, (None, None))
            if stub is not None and p.address:
                yield p.name, p.address, stub, req

    async def holding(self, request_ids: Sequence[str], prefix: str = "") -> dict[str, list[str]]:
        """Instance name → the request ids (of ``request_ids``) whose KV it holds."""
        out: dict[str, list[str]] = {}
        for name, address, stub, req in self._targets():
            if not name.startswith(prefix):
                continue
            async with grpc.aio.insecure_channel(address) as ch:
                s = stub(ch)
                held = []
                for rid in request_ids:
                    try:
                        r = await s.DescribeCache(req(request_id=rid), timeout=2)
                    except grpc.aio.AioRpcError:
                        break
                    if r.request_holds_kv:
                        held.append(rid)
                out[name] = held
        return out

    async def blocks_used(self) -> dict[str, int]:
        out = {}
        for name, address, stub, req in self._targets():
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    r = await stub(ch).DescribeCache(req(), timeout=5)
                    out[name] = r.kv_blocks_used
                except grpc.aio.AioRpcError:
                    out[name] = -1
        return out
