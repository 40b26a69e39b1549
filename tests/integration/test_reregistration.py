"""An instance whose lease lapsed re-registers and republishes its whole radix cache.

A real kvstore (gRPC on port 0, real Redis) and a real ``EngineInstance`` on a
tiny model: a request runs through the engine, so its prompt's full blocks sit
in the radix cache and kvstore's PredictHits sees them. Then the lease lapses
the way it does in production — Redis drops the instance's record, its lease
and its block set together (we delete exactly those keys instead of stalling
the process for a whole TTL) — the next heartbeat finds the instance unknown,
re-registers with a reset index and republishes the cache snapshot, and
PredictHits must answer as before the lapse.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from redis.asyncio import Redis

from pdd.core.cache_event import CacheEvent
from pdd.core.instance import InstanceRef, Role
from pdd.engine.config import EngineConfig
from pdd.engine.sampling import SamplingParams
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.prefix_index.registry import InstanceRegistry
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.serving.engine_instance import EngineInstance, InstanceConfig
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

MODEL = "tiny:7,ctx=512"
BLOCK = 4
SALT = "tenant-a"
TTL_MS = 1500  # heartbeats every 0.5 s, so a lapse is noticed quickly
PROMPT = [1 + (i * 7) % 250 for i in range(22)]  # 5 full blocks of 4 → 20 cacheable tokens


@pytest.fixture
async def kvstore(redis_url, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5), redis_url=redis_url, key_prefix=key_prefix
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield f"127.0.0.1:{port}", pb_grpc.KvstoreServiceStub(channel)
    await channel.close()
    await server.stop()


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _start(
    cls: type[EngineInstance], kvstore_address: str, instance_id: str
) -> EngineInstance:
    ref = InstanceRef(instance_id, "127.0.0.1:1", Role.MAIN_DECODE)
    instance = cls(
        InstanceConfig(
            ref,
            kvstore_address,
            MODEL,
            EngineConfig(block_size=BLOCK, num_blocks=64),
            lease_ttl_ms=TTL_MS,
        )
    )
    await instance.start()
    await instance.register(1)
    return instance


async def _run(instance: EngineInstance, request_id: str, prompt: list[int]) -> None:
    """One short request through the runner; its prompt's full blocks end in the radix cache."""
    runner = instance.runner
    queue = runner.open(request_id)
    try:
        await runner.call(
            instance.engine.add_request, request_id, prompt, SamplingParams(max_tokens=1), salt=SALT
        )
        while True:
            out = await asyncio.wait_for(queue.get(), 30)
            if isinstance(out, BaseException):
                raise out
            if not isinstance(out, tuple) and out.finished:
                break
    finally:
        runner.close(request_id)


async def _hits(stub, instance_id: str, prompt: list[int], salt: str = SALT) -> int:
    resp = await stub.PredictHits(
        pb.PredictHitsRequest(prompt_token_ids=prompt, cache_salt=salt, instance_ids=[instance_id])
    )
    assert [h.instance.ref.instance_id for h in resp.hits] == [instance_id], (
        "instance is not registered"
    )
    return resp.hits[0].cached_tokens


async def _lapse(redis: Redis, key_prefix: str, instance_id: str) -> None:
    """What a lapsed lease leaves in Redis: the record, the lease and the block set are gone."""
    registry = InstanceRegistry(redis, key_prefix)
    inst_key = registry.instance_key(instance_id)
    assert await redis.delete(inst_key, f"{inst_key}:lease", registry.blocks_key(instance_id)) == 3


async def _wait_resynced(instance: EngineInstance, resyncs: int) -> None:
    async def wait() -> None:
        while instance.membership.resyncs < resyncs:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(wait(), 10 * TTL_MS / 1000)
    await instance.membership.flush()


async def test_reregistered_instance_republishes_its_radix_cache(kvstore, redis, key_prefix):
    address, stub = kvstore
    instance = await _start(EngineInstance, address, "md-0")
    try:
        await _run(instance, "r1", PROMPT)
        await instance.membership.flush()
        assert await _hits(stub, "md-0", PROMPT) == 20
        assert await _hits(stub, "md-0", PROMPT, salt="") == 0  # the salt is part of every hash
        # A second prompt sharing the first 2 blocks splits the radix node: the snapshot
        # must chain the branch from the split point exactly as the live events did.
        branch = PROMPT[:8] + [200 + i for i in range(12)] + [9]
        await _run(instance, "r2", branch)
        await instance.membership.flush()
        before = (await _hits(stub, "md-0", PROMPT), await _hits(stub, "md-0", branch))
        assert before == (20, 20)
        blocks_key = InstanceRegistry(redis, key_prefix).blocks_key("md-0")
        assert (
            await redis.scard(blocks_key) == 8
        )  # PROMPT's 5 blocks + the branch's 3 past the shared 2

        await _lapse(redis, key_prefix, "md-0")
        await _wait_resynced(instance, 1)

        assert (await _hits(stub, "md-0", PROMPT), await _hits(stub, "md-0", branch)) == before
        assert await _hits(stub, "md-0", PROMPT, salt="") == 0
        assert await redis.scard(blocks_key) == 8
    finally:
        await instance.stop()


class _ClearsWhileSnapshotting(EngineInstance):
    """Clears the radix cache on the engine thread right after the snapshot was read.

    The "cleared" events then reach ``Membership.publish`` while it still awaits the
    snapshot — the window where a live event could overtake it and be undone by it.
    """

    async def _snapshot(self) -> list[CacheEvent]:
        read = asyncio.ensure_future(super()._snapshot())
        await asyncio.sleep(0)  # let it queue its read on the engine thread first
        self.runner.submit(self.engine.blocks.cache.reset)
        # NOTE: the engine thread runs calls in order, so by the time this no-op returns the
        # reset's events were handed to the event loop ahead of it and published.
        await self.runner.call(lambda: None)
        events = await read
        assert events, "the snapshot was read before the reset"
        return events


async def test_events_after_the_snapshot_read_are_applied_after_it(kvstore, redis, key_prefix):
    address, stub = kvstore
    instance = await _start(_ClearsWhileSnapshotting, address, "md-1")
    try:
        await _run(instance, "r1", PROMPT)
        await instance.membership.flush()
        assert await _hits(stub, "md-1", PROMPT) == 20

        await _lapse(redis, key_prefix, "md-1")
        await _wait_resynced(instance, 1)

        # The cache is empty now; a snapshot applied after the "cleared" events would claim 20.
        assert await instance.runner.call(instance.engine.prefix_match_len, PROMPT, SALT) == 0
        assert await _hits(stub, "md-1", PROMPT) == 0
    finally:
        await instance.stop()
