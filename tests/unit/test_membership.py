"""An instance's membership against in-process kvstores: the real ``PrefixStore`` over the real
Redis the tests start, and a recorder shaped like it (``KvstoreClient``'s calls) for what a
store cannot show — a failed snapshot retried, a kvstore that is down for a while.

The lease lapses the way it does in production: Redis drops the instance's record, lease and
block set together (we delete exactly those keys), the next heartbeat finds the instance
unknown, and membership re-registers with a reset index and republishes the cache snapshot
ahead of every event emitted after it was read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from redis.asyncio import Redis

from pdd.core.block_hash import ROOT_HASH, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.errors import PeerError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.prefix_index.registry import InstanceRegistry
from pdd.prefix_index.store import PrefixStore
from pdd.serving.membership import Membership

BLOCK = 4
SALT = "tenant-a"
TTL_MS = 300  # heartbeats every 0.1 s
PROMPT = [1 + (i * 7) % 250 for i in range(22)]  # 5 full blocks of 4
HASHES = chain_hashes(PROMPT, BLOCK, SALT)


def _instance(instance_id: str) -> Instance:
    return Instance(InstanceRef(instance_id, "127.0.0.1:1", Role.MAIN_DECODE), BLOCK, "tiny")


def _stored(blocks: int) -> CacheEvent:
    return CacheEvent(
        "stored", tuple(HASHES[:blocks]), ROOT_HASH, SALT, BLOCK, tuple(PROMPT[: blocks * BLOCK])
    )


def _evicted(index: int) -> CacheEvent:
    parent = HASHES[index - 1] if index else ROOT_HASH
    return CacheEvent("evicted", (HASHES[index],), parent, SALT, BLOCK)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout_s)


@pytest.fixture
async def store(redis_url, key_prefix):
    redis = Redis.from_url(redis_url)
    yield PrefixStore(redis, key_prefix)
    await redis.aclose()


async def _hits(store: PrefixStore, instance_id: str) -> int:
    hits = await store.predict(PROMPT, SALT, instance_ids=[instance_id])
    assert [h.instance.ref.instance_id for h in hits] == [instance_id], "not registered"
    return hits[0].cached_tokens


async def test_a_lapsed_lease_reregisters_and_the_snapshot_precedes_newer_events(store, key_prefix):
    cache = [_stored(5)]  # what the engine's radix cache holds
    member: Membership

    async def snapshot() -> list[CacheEvent]:
        read = list(cache)
        # NOTE: the engine evicts a block right after the snapshot was read, while membership
        # still awaits it: the eviction must reach the index after the snapshot, not before.
        member.publish(_evicted(4))
        await asyncio.sleep(0.05)
        return read

    member = Membership(store, _instance("md-0"), ttl_ms=TTL_MS, snapshot=snapshot)
    await member.start()
    try:
        member.publish(_stored(5))
        await member.flush()
        assert await _hits(store, "md-0") == 20

        registry = InstanceRegistry(store.redis, key_prefix)
        key = registry.instance_key("md-0")
        assert await store.redis.delete(key, f"{key}:lease", registry.blocks_key("md-0")) == 3

        await _until(lambda: member.resyncs == 1)
        await member.flush()
        # Snapshot (5 blocks) first, then the eviction of the 5th: 4 blocks remain.
        assert await _hits(store, "md-0") == 16
        assert await store.redis.scard(registry.blocks_key("md-0")) == 4
    finally:
        await member.stop()
    assert await store.list() == []  # deregistered


class RecordingKvstore:
    """``KvstoreClient``'s calls membership makes, recorded; ``down`` fails them as a lost
    kvstore does (``PeerError``), ``known`` is what the next heartbeat answers."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.known = True
        self.down = False
        self.refused = 0  # calls made while down

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            raise PeerError("UNAVAILABLE", "connection refused", "kvstore")

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        self._check()
        self.calls.append(("register", reset_index))
        self.known = True

    async def heartbeat(self, instance_id: str, load: InstanceLoad) -> bool:
        self._check()
        self.calls.append(("heartbeat", load.running_requests))
        return self.known

    async def deregister(self, instance_id: str) -> None:
        self._check()
        self.calls.append(("deregister",))

    async def publish(
        self, instance_id: str, events: Sequence[CacheEvent], *, first_seq: int = 0
    ) -> int:
        self._check()
        self.calls.append(("publish", *events))
        return len(events)

    def published(self) -> list[CacheEvent]:
        return [e for call in self.calls if call[0] == "publish" for e in call[1:]]

    def count(self, name: str) -> int:
        return sum(1 for call in self.calls if call[0] == name)


async def test_a_failed_snapshot_is_retried_and_a_lost_kvstore_does_not_end_the_heartbeats():
    kv = RecordingKvstore()
    snapshots: list[int] = []

    async def snapshot() -> list[CacheEvent]:
        snapshots.append(1)
        if len(snapshots) == 1:
            raise RuntimeError("engine thread busy")
        return [_stored(5)]

    member = Membership(
        kv, _instance("md-1"), ttl_ms=TTL_MS, load=lambda: InstanceLoad(3), snapshot=snapshot
    )
    await member.start()
    try:
        assert kv.calls == [("register", True)]
        await _until(lambda: kv.count("heartbeat") >= 1)
        assert ("heartbeat", 3) in kv.calls  # the load rides on the heartbeat

        kv.down = True  # kvstore unreachable: heartbeats fail, membership keeps trying
        await _until(lambda: kv.refused >= 3)
        kv.down = False
        beats = kv.count("heartbeat")
        await _until(lambda: kv.count("heartbeat") > beats)

        kv.known = False  # the lease lapsed meanwhile
        await _until(lambda: member.resyncs == 1)
        assert len(snapshots) == 2  # the failed one was retried on the next heartbeat
        member.publish(_evicted(4))
        await member.flush()
        assert kv.published() == [_stored(5), _evicted(4)]
        assert kv.count("register") == 3  # start, then once per resync attempt (reset each time)
        assert all(call[1] for call in kv.calls if call[0] == "register")
    finally:
        await member.stop()
    assert kv.calls[-1] == ("deregister",)
