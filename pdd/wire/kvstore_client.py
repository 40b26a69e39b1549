"""The typed client of kvstore, shaped like ``pdd.prefix_index.store.PrefixStore`` (the domain it
fronts): instances register, heartbeat and publish cache events (``pdd.serving.membership``);
the gateway lists instances and asks for predicted hits."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import grpc

from pdd.core.block_hash import PromptChains
from pdd.core.cache_event import CacheEvent, PublishResult
from pdd.core.errors import PeerError
from pdd.core.instance import Instance, InstanceLoad, Role
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.prefix_index.store import Hit
from pdd.server.interceptors import outgoing_metadata
from pdd.wire import kvstore as conv
from pdd.wire.call import unary
from pdd.wire.common import role_to_pb

PEER = "kvstore"


class KvstoreClient:
    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float = 5.0) -> None:
        """``timeout_s``: the deadline of each call unless the call names its own."""
        self._stub = pb_grpc.KvstoreServiceStub(channel)
        self.timeout_s = timeout_s

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        msg = conv.register_to_pb(inst, ttl_ms, reset_index)
        await unary(PEER, self._stub.RegisterInstance(msg, timeout=self.timeout_s))

    async def heartbeat(
        self, instance_id: str, load: InstanceLoad, *, timeout_s: float | None = None
    ) -> bool:
        """Whether kvstore still knew the instance (False: its lease had lapsed)."""
        msg = pb.HeartbeatRequest(instance_id=instance_id, load=conv.load_to_pb(load))
        resp = await unary(PEER, self._stub.Heartbeat(msg, timeout=timeout_s or self.timeout_s))
        return resp.known

    async def deregister(self, instance_id: str, *, timeout_s: float | None = None) -> None:
        msg = pb.DeregisterInstanceRequest(instance_id=instance_id)
        await unary(PEER, self._stub.DeregisterInstance(msg, timeout=timeout_s or self.timeout_s))

    async def list(self, role: Role | None = None) -> list[Instance]:
        msg = pb.ListInstancesRequest(role=role_to_pb(role) if role else 0)
        resp = await unary(PEER, self._stub.ListInstances(msg, timeout=self.timeout_s))
        return [conv.instance_from_pb(m, f"instances[{i}]") for i, m in enumerate(resp.instances)]

    async def publish(
        self, instance_id: str, events: Sequence[CacheEvent], *, first_seq: int = 0
    ) -> PublishResult:
        """Apply ``events`` to the instance's index entries (``first_seq``: the first one's
        sequence number, 0: unsequenced); how many were applied, and whether kvstore saw a gap
        and asks for a resync."""
        msg = pb.PublishCacheEventsRequest(
            instance_id=instance_id,
            events=[conv.cache_event_to_pb(e) for e in events],
            first_seq=first_seq,
        )
        resp = await unary(PEER, self._stub.PublishCacheEvents(msg, timeout=self.timeout_s))
        return PublishResult(resp.applied, resp.resync)

    async def predict(
        self, prompt: Sequence[int], salt: str = "", *, block_sizes: Collection[int] = ()
    ) -> list[Hit]:
        """Every live instance with how many leading tokens of ``prompt`` it is predicted to hold.

        ``block_sizes``: those of the instances the caller knows. The prompt then goes hashed at
        each (``PromptChains``: 8 bytes a block where its token ids are 64 at block 16, and
        kvstore hashes nothing), and once more as token ids when kvstore has an instance of
        another block size (it answers FAILED_PRECONDITION). Without them, as token ids (packed).
        """
        if block_sizes:
            try:
                return await self._predict(PromptChains.of(prompt, block_sizes, salt), salt)
            except PeerError as exc:
                if exc.code != "FAILED_PRECONDITION":
                    raise
        return await self._predict(prompt, salt)

    async def _predict(self, prompt: Sequence[int] | PromptChains, salt: str) -> list[Hit]:
        msg = conv.predict_to_pb(prompt, salt)
        call = self._stub.PredictHits(msg, timeout=self.timeout_s, metadata=outgoing_metadata())
        resp = await unary(PEER, call)
        return [conv.hit_from_pb(h, i) for i, h in enumerate(resp.hits)]
