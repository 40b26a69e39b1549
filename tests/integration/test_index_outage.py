"""A real Redis restart under a running kvstore and a member instance.

A redis-server of the test's own (so it can be SIGKILLed) behind a kvstore servicer on port 0 and
an instance's ``Membership`` over gRPC that holds a prompt's blocks. Redis dies: kvstore answers
UNAVAILABLE at once (not INTERNAL, no hang) and keeps serving; the gateway's ``InstanceView``
routes from what it last knew. Redis comes back on the same port, empty: the next heartbeat finds
the lease unknown, the instance re-registers and republishes its cache snapshot, and PredictHits
answers as before. An instance restarted with the same id and address re-registers with a reset
index: the claims of its previous life are gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdd.core.block_hash import ROOT_HASH, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.errors import PeerError
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.prefix_index.redis_server import start_redis
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.serving.instance_view import InstanceView
from pdd.serving.membership import Membership
from pdd.wire.kvstore_client import KvstoreClient
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

BLOCK = 4
SALT = "tenant-a"
TTL_MS = 1500  # heartbeats every 0.5 s
PROMPT = [1 + (i * 7) % 250 for i in range(22)]  # 5 full blocks → 20 cached tokens
INSTANCE = Instance(InstanceRef("md-0", "127.0.0.1:7003", Role.MAIN_DECODE, "remote"), BLOCK)


def _stored(tokens: list[int]) -> CacheEvent:
    n = len(tokens) // BLOCK * BLOCK
    hashes = tuple(chain_hashes(tokens, BLOCK, SALT))
    return CacheEvent("stored", hashes, ROOT_HASH, SALT, BLOCK, tuple(tokens[:n]))


class Redis:
    """A redis-server the test can kill and start again on the same port."""

    def __init__(self, log_dir) -> None:
        self.log_dir = log_dir
        self.proc, self.url = start_redis(log_dir)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.proc, url = start_redis(self.log_dir, port=self.port)
        assert url == self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis(tmp_path):
    server = Redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture
async def kvstore(redis, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5),
        redis_url=redis.url,
        key_prefix=key_prefix,
        redis_timeout_s=0.5,
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield KvstoreClient(channel, timeout_s=2.0)
    await channel.close()
    await server.stop()


async def _cached(kv: KvstoreClient) -> int | None:
    """md-0's predicted cached tokens of PROMPT; None when it is not registered."""
    hits = {h.instance.ref.instance_id: h.cached_tokens for h in await kv.predict(PROMPT, SALT)}
    return hits.get("md-0")


async def _eventually_cached(kv: KvstoreClient, want: int, within_s: float) -> None:
    async def poll() -> None:
        while True:
            try:
                if await _cached(kv) == want:
                    return
            except PeerError as exc:
                # NOTE: the first call after the restart may still meet a dead pooled connection.
                assert exc.code == "UNAVAILABLE", exc
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), within_s)


async def test_a_restarted_redis_is_refilled_by_the_next_heartbeat(redis, kvstore):
    kv = kvstore

    async def snapshot() -> list[CacheEvent]:
        return [_stored(PROMPT)]

    member = Membership(kv, INSTANCE, ttl_ms=TTL_MS, snapshot=snapshot)
    await member.start()
    view = InstanceView(lambda: kv, refresh_s=60.0)
    try:
        member.publish(_stored(PROMPT))
        await member.flush()
        assert await _cached(kv) == 20
        assert [h.cached_tokens for h in await view.predict(PROMPT, SALT)] == [20]

        redis.kill()
        for call in (kv.predict(PROMPT, SALT), kv.list(), kv.heartbeat("md-0", INSTANCE.load)):
            t0 = time.monotonic()
            with pytest.raises(PeerError) as err:
                await call
            assert err.value.code == "UNAVAILABLE" and "Redis" in err.value.details
            assert time.monotonic() - t0 < 2.0  # a generous bound: fail fast, never hang
        # The gateway's view routes on from the last known instance, no hit known.
        hits = await view.predict(PROMPT, SALT)
        assert [(h.instance.ref, h.cached_tokens) for h in hits] == [(INSTANCE.ref, 0)]
        assert view.outage_fallbacks == 1

        redis.restart()
        # Within a few heartbeats (0.5 s each): re-registered, the snapshot republished.
        await _eventually_cached(kv, 20, within_s=10 * TTL_MS / 1000 / 3)
        assert member.resyncs >= 1
        assert [h.cached_tokens for h in await view.predict(PROMPT, SALT)] == [20]
        assert view.outage_fallbacks == 0  # the outage is over
    finally:
        await view.close()
        await member.stop()


async def test_an_instance_restarted_at_the_same_address_drops_its_old_claims(kvstore):
    kv = kvstore
    # Its previous life registered and published, then died without deregistering.
    await kv.register(INSTANCE, 60_000)
    await kv.publish("md-0", [_stored(PROMPT)])
    assert await _cached(kv) == 20

    reborn = Membership(kv, INSTANCE, ttl_ms=TTL_MS)  # an empty cache
    await reborn.start()
    try:
        assert await _cached(kv) == 0  # registered, and none of the old claims stand
        assert [i.ref for i in await kv.list()] == [INSTANCE.ref]
        reborn.publish(_stored(PROMPT[:8]))
        await reborn.flush()
        assert await _cached(kv) == 8
    finally:
        await reborn.stop()
