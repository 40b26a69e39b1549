"""A gap in the cache events kvstore saw (a batch given up on while kvstore was down, its Redis
keeping the lease) is mended by a full snapshot once kvstore answers again, as a lapsed lease is."""

from __future__ import annotations

import asyncio

from pdd.core.block_hash import ROOT_HASH
from pdd.core.cache_event import CacheEvent
from pdd.core.errors import PeerError
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.serving.membership import Membership

INSTANCE = Instance(InstanceRef("md-0", "127.0.0.1:7003", Role.MAIN_DECODE), 4)
LIVE = CacheEvent("evicted", (11,), ROOT_HASH, "", 4)
SNAPSHOT = CacheEvent("stored", (22,), ROOT_HASH, "", 4, (1, 2, 3, 4))


class FlakyKvstore:
    """kvstore that fails every call while ``down``; its Redis keeps the lease throughout."""

    def __init__(self) -> None:
        self.down = False
        self.registered: list[bool] = []  # reset_index of each registration
        self.published: list[CacheEvent] = []

    def _answer(self) -> None:
        if self.down:
            raise PeerError("UNAVAILABLE", "kvstore is down", "kvstore")

    async def register(self, inst, ttl_ms, *, reset_index=False) -> None:
        self._answer()
        self.registered.append(reset_index)

    async def heartbeat(self, instance_id, load) -> bool:
        self._answer()
        return True  # the lease outlived the outage: only the dropped batch says "resync"

    async def deregister(self, instance_id) -> None:
        self._answer()

    async def publish(self, instance_id, events, *, first_seq=0) -> int:
        self._answer()
        self.published.extend(events)
        return len(events)


async def test_a_dropped_batch_of_cache_events_is_mended_by_a_snapshot():
    kv = FlakyKvstore()

    async def snapshot() -> list[CacheEvent]:
        return [SNAPSHOT]

    member = Membership(kv, INSTANCE, ttl_ms=300, snapshot=snapshot)
    await member.start()
    try:
        kv.down = True
        member.publish(LIVE)
        await member.flush(timeout=10)  # every retry failed: the batch is given up on
        assert kv.published == [] and member.resyncs == 0
        kv.down = False

        async def resynced() -> None:
            while member.resyncs < 1:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(resynced(), 10)
        await member.flush()
        assert kv.registered == [True, True]  # start, then the resync with a reset index
        assert kv.published == [SNAPSHOT]
    finally:
        await member.stop()
