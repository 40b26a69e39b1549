"""kvstore's Redis connections (a real server): all opened at start and kept, never more under a
burst of calls — its descriptors are flat from its start (what the soak checks) — and a call that
finds them all busy waits for one instead of failing."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from redis.asyncio import Redis

from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build, connect_redis, open_connections

NAME = "pdd-kvstore-conn-test"


async def _clients(redis_url: str, name: str) -> int:
    """Connections Redis sees from clients named ``name``."""
    admin = Redis.from_url(redis_url)
    try:
        return sum(c.get("name") == name for c in await admin.client_list())
    finally:
        await admin.aclose()


async def test_every_connection_is_opened_at_start_and_a_burst_opens_no_more(redis_url, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5),
        redis_url=f"{redis_url}?client_name={NAME}-{key_prefix}",
        key_prefix=key_prefix,
        redis_connections=4,
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await _clients(redis_url, f"{NAME}-{key_prefix}") == 4  # all open before any call
        stub = pb_grpc.KvstoreServiceStub(channel)
        ref = common_pb2.InstanceRef(
            instance_id="md-0", address="127.0.0.1:9", role=common_pb2.ROLE_MAIN_DECODE
        )
        await stub.RegisterInstance(
            pb.RegisterInstanceRequest(ref=ref, block_size=4, ttl_ms=60_000, model="tiny")
        )
        request = pb.PredictHitsRequest()
        request.prompt_token_ids.extend(range(1, 65))
        # 64 calls at once over 4 connections: each waits its turn, none fails
        answers = await asyncio.gather(*(stub.PredictHits(request) for _ in range(64)))
        assert all(len(a.hits) == 1 for a in answers)
        assert await _clients(redis_url, f"{NAME}-{key_prefix}") == 4
    finally:
        await channel.close()
        await server.stop()


async def test_open_connections_fills_the_pool_and_gives_them_back(redis_url):
    redis = connect_redis(redis_url, 2.0, connections=3)
    try:
        assert await open_connections(redis) == 3
        pool = redis.connection_pool
        assert len(pool._in_use_connections) == 0  # all handed back, kept for the calls
        assert await redis.ping()
    finally:
        await redis.aclose()


def test_the_pool_is_at_least_one_connection():
    with pytest.raises(ValueError, match="^redis_connections:"):
        KvstoreConfig(redis_connections=0)
