"""Link state from prefill to the router over the real path: a prefill's membership heartbeats its
``LinkState``s with its load → kvstore (real gRPC port, real Redis) stores them with the instance
→ ListInstances and PredictHits return them → the gateway's instance view routes on them, and
keeps routing on the last known ones while kvstore is down."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.link_state import LinkState
from pdd.core.pipeline import Pipeline
from pdd.routing.policy import RouteReason, route
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.serving.instance_view import InstanceView
from pdd.serving.membership import Membership
from pdd.wire.kvstore_client import KvstoreClient
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

LINKS = (
    LinkState("east", 2.5e8, 1000, 2000, 0.004, 1_700_000_000_000, True),
    LinkState("west", 1e5, 0, 0, 0.09, 1_700_000_000_001, False),
)


@pytest.fixture
async def kvstore(redis_url, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.2), redis_url=redis_url, key_prefix=key_prefix
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield server, KvstoreClient(channel, timeout_s=1.0)
    await channel.close()
    await server.stop()


def _inst(iid: str, role: Role, cluster: str = "main") -> Instance:
    return Instance(InstanceRef(iid, "127.0.0.1:9", role, cluster), 4, "tiny")


async def _until(predicate, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (got := await predicate()):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return got


async def test_links_travel_from_prefill_to_the_router_and_outlive_an_outage(kvstore):
    server, client = kvstore
    links = [()]  # what prefill's meters say now; the heartbeat reads it each time
    prefill = Membership(
        client,
        _inst("p-0", Role.PREFILL),
        ttl_ms=600,
        load=lambda: InstanceLoad(running_requests=1, links=links[0]),
    )
    others = [
        Membership(client, _inst("md-east", Role.MAIN_DECODE, "east"), ttl_ms=600),
        Membership(client, _inst("md-west", Role.MAIN_DECODE, "west"), ttl_ms=600),
        Membership(client, _inst("rld-0", Role.RELAY), ttl_ms=600),
    ]
    for m in (prefill, *others):
        await m.start()
    try:
        links[0] = LINKS

        async def published():
            listed = {i.ref.instance_id: i for i in await client.list()}
            return "p-0" in listed and listed["p-0"].load.links == LINKS

        await _until(published)
        hits = {h.instance.ref.instance_id: h.instance for h in await client.predict([1, 2, 3, 4])}
        assert hits["p-0"].load.links == LINKS and hits["p-0"].load.running_requests == 1
        assert hits["md-east"].load.links == ()  # only prefill reports links

        view = InstanceView(lambda: client, hold_s=60.0)
        up = await view.predict(list(range(64)))
        r = route(64, [h.instance for h in up], {}, random.Random(0), kv_bytes_per_token=512)
        # west's link is unhealthy; east's is fast: the delta crosses well within the budget
        assert (r.main_decode.ref.instance_id, r.pipeline, r.reason) == (
            "md-east",
            Pipeline.P_MD,
            RouteReason.LINK_BUDGET,
        )

        await server.stop()  # kvstore goes away
        down = await view.predict(list(range(64)))
        assert view.outage_fallbacks == 1
        prefill_seen = next(h.instance for h in down if h.instance.ref.role is Role.PREFILL)
        assert prefill_seen.load.links == LINKS  # the last known state, routed on
        r2 = route(64, [h.instance for h in down], {}, random.Random(0), kv_bytes_per_token=512)
        assert (r2.main_decode.ref.instance_id, r2.pipeline) == ("md-east", Pipeline.P_MD)
    finally:
        for m in (prefill, *others):
            for t in m._tasks:
                t.cancel()
            await asyncio.gather(*m._tasks, return_exceptions=True)
