"""kvstore's gRPC face: proto → domain → ``PrefixStore`` → proto.

The domain (registry + prefix index over Redis) lives in ``pdd.prefix_index``. A Redis that goes
away while kvstore runs makes each call answer UNAVAILABLE (after at most ``redis_timeout_s``) and
kvstore keeps serving; the next call after Redis returns reconnects. At start, an unreachable
Redis fails kvstore at once, so a misconfigured ``--redis-url`` is seen, not served around.
"""

from __future__ import annotations

import grpc
import structlog
from prometheus_client import Counter
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster

from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.prefix_index.redis_outage import redis_address, redis_outage
from pdd.prefix_index.store import PrefixStore
from pdd.server.bootstrap import ServiceSpec
from pdd.wire import kvstore as conv
from pdd.wire.common import role_from_pb
from services.kvstore.config import KvstoreConfig, is_cluster_url

log = structlog.get_logger(__name__)

INDEX_GAPS = Counter(
    "pdd_kvstore_index_resyncs_requested",
    "Batches of cache events refused for a gap in their instance's sequence (events lost): each "
    "answered with resync, so the instance republishes its whole cache",
)


class KvstoreServicer(pb_grpc.KvstoreServiceServicer):
    def __init__(self, store: PrefixStore) -> None:
        self.store = store

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context
    ) -> pb.RegisterInstanceResponse:
        inst, ttl_ms = conv.register_from_pb(request)
        await self.store.register(inst, ttl_ms, reset_index=request.reset_index)
        return pb.RegisterInstanceResponse(ttl_ms=ttl_ms)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = await self.store.heartbeat(
            conv.require_instance_id(request.instance_id), conv.load_from_pb(request.load)
        )
        return pb.HeartbeatResponse(known=known)

    async def DeregisterInstance(self, request, context) -> pb.DeregisterInstanceResponse:
        await self.store.deregister(conv.require_instance_id(request.instance_id))
        return pb.DeregisterInstanceResponse()

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context
    ) -> pb.ListInstancesResponse:
        instances = await self.store.list(role_from_pb(request.role, "role", optional=True))
        return pb.ListInstancesResponse(instances=[conv.instance_to_pb(i) for i in instances])

    async def PublishCacheEvents(
        self, request: pb.PublishCacheEventsRequest, context
    ) -> pb.PublishCacheEventsResponse:
        instance_id = conv.require_instance_id(request.instance_id)
        events = [conv.cache_event_from_pb(ev, i) for i, ev in enumerate(request.events)]
        result = await self.store.publish(instance_id, events, first_seq=request.first_seq)
        if result.resync:
            INDEX_GAPS.inc()
            log.warning("cache_event_gap_resync_requested", instance_id=instance_id)
        return pb.PublishCacheEventsResponse(applied=result.applied, resync=result.resync)

    async def PredictHits(self, request: pb.PredictHitsRequest, context) -> pb.PredictHitsResponse:
        hits = await self.store.predict(**conv.predict_from_pb(request))
        return pb.PredictHitsResponse(hits=[conv.hit_to_pb(h) for h in hits])


def connect_redis(url: str, timeout_s: float, connections: int = 16) -> Redis | RedisCluster:
    """A client for ``url``: ``redis+cluster://`` (``rediss+cluster://``) is a Redis Cluster.
    At most ``connections`` sockets (per node on a cluster); a call finding them all busy waits
    up to ``timeout_s`` for one."""
    timeouts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if is_cluster_url(url):
        return RedisCluster.from_url(
            url.replace("+cluster", "", 1), max_connections=connections, **timeouts
        )
    pool = BlockingConnectionPool.from_url(
        url, max_connections=connections, timeout=timeout_s, **timeouts
    )
    return Redis(connection_pool=pool)


async def open_connections(redis: Redis | RedisCluster) -> int:
    """Open every connection of ``redis``'s pool now (a single server's; a cluster's open on
    demand); how many. NOTE: kvstore's descriptors are then flat from its start, whatever the
    load: a soak that watches them sees no high-water mark climbing with concurrency."""
    if isinstance(redis, RedisCluster):
        return 0
    pool = redis.connection_pool
    held = []
    try:
        for _ in range(pool.max_connections):
            held.append(await pool.get_connection())
    finally:
        for conn in held:
            await pool.release(conn)
    return len(held)


def build(config: KvstoreConfig) -> ServiceSpec:
    """The kvstore as a ServiceSpec for the shared bootstrap."""
    redis = connect_redis(config.redis_url, config.redis_timeout_s, config.redis_connections)
    servicer = KvstoreServicer(PrefixStore(redis, config.key_prefix))

    async def start() -> None:
        # NOTE: fail fast (and visibly) when Redis is not there at start; later outages are
        # answered per call (UNAVAILABLE), never fatal.
        with redis_outage(redis_address(redis)):
            await redis.ping()
            await open_connections(redis)

    async def stop() -> None:
        await redis.aclose()

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_KvstoreServiceServicer_to_server(servicer, server)

    return ServiceSpec(
        "kvstore",
        [pb.DESCRIPTOR.services_by_name["KvstoreService"].full_name],
        register,
        start,
        stop,
    )
