"""Two remote clusters, one behind a fast link and one behind a slow one, each its own emulator.

Every MainDecode registers with its cluster and is dialled through its cluster's link (the
address it advertises is that link's route); requests are served by both clusters; the slow
cluster's bytes (KV pushes, token streams) cross ``wan-slow`` and only it — its /metrics counts
them under the slow MainDecode's route, and ``wan-fast`` never sees that route.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
import pytest

from pdd.client import generate_stream
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kv_pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as kv_grpc
from pdd.testbed.stack import ClusterSpec, LinkSettings
from tests.e2e.conftest import make_stack

CLUSTERS = (
    ClusterSpec("fast", LinkSettings(mbps=0, delay_ms=1)),
    ClusterSpec("slow", LinkSettings(mbps=20, delay_ms=30)),
)
MDS = {"main_decode-fast-0": "fast", "main_decode-slow-0": "slow"}


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(redis_url, tmp_path_factory.mktemp("clusters"), clusters=CLUSTERS)
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


def _link_bytes(address: str) -> dict[tuple[str, str], float]:
    """``pdd_wan_link_bytes_total`` of a link by (route, direction)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdd_wan_link_bytes_total{"):
            labels, value = line.removeprefix("pdd_wan_link_bytes_total").rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in labels.strip("{}").split(","))
            out[fields["route"].strip('"'), fields["direction"].strip('"')] = float(value)
    return out


def _upstream_of(stack, md: str) -> str:
    return f"127.0.0.1:{stack.by_name(md).port}"


async def test_every_main_decode_registered_with_its_cluster_behind_its_link(stack):
    assert stack.cluster_of == MDS
    async with grpc.aio.insecure_channel(stack.by_name("kvstore").address) as ch:
        resp = await kv_grpc.KvstoreServiceStub(ch).ListInstances(kv_pb.ListInstancesRequest())
    mds = {
        i.ref.instance_id: (i.ref.cluster, i.ref.address)
        for i in resp.instances
        if i.ref.role == common_pb2.ROLE_MAIN_DECODE
    }
    assert mds == {name: (cluster, stack.advertised[name]) for name, cluster in MDS.items()}
    for name, cluster in MDS.items():
        assert stack.link_of[name] == f"wan-{cluster}"
        # The advertised address is a route of the cluster's own link, to this MainDecode.
        link = stack.by_name(f"wan-{cluster}")
        assert f"{stack.advertised[name]}={_upstream_of(stack, name)}" in link.args


async def _generate(stack, prompt: list[int], n: int):
    tokens, final = [], None
    async for resp in generate_stream(
        stack.gateway.address, prompt, max_tokens=n, timeout=120, ignore_eos=True
    ):
        tokens.extend(resp.token_ids)
        if resp.HasField("stats"):
            final = resp
    assert final is not None and len(tokens) == n
    return final.stats


async def test_requests_are_served_by_both_clusters_each_through_its_own_link(stack):
    before = {c.name: _link_bytes(stack.metrics[f"wan-{c.name}"]) for c in CLUSTERS}
    rng = random.Random(5)
    served: dict[str, list] = {name: [] for name in MDS}
    # Cold, distinct prompts: equal load ties are broken at random and concurrent requests
    # count as load, so a few rounds reach both clusters (2^-20 that 20 requests do not).
    for _ in range(5):
        if all(served.values()):
            break
        batch = [[rng.randrange(1, 256) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
        for stats in await asyncio.gather(*(_generate(stack, p, 8) for p in batch)):
            served[stats.main_decode_instance].append(stats)
    assert all(served.values()), {k: len(v) for k, v in served.items()}
    after = {c.name: _link_bytes(stack.metrics[f"wan-{c.name}"]) for c in CLUSTERS}
    for name, cluster in MDS.items():
        route = _upstream_of(stack, name)
        up = after[cluster][route, "up"] - before[cluster].get((route, "up"), 0)
        down = after[cluster][route, "down"] - before[cluster].get((route, "down"), 0)
        # KV pushes (and the decode calls) went up this link, the streamed tokens came down it.
        assert up >= sum(s.wan_kv_bytes for s in served[name]) and up > 0, (name, up)
        assert down > 0, (name, down)
        # ... and only this one: the other cluster's link has no route to this MainDecode.
        other = next(c.name for c in CLUSTERS if c.name != cluster)
        assert all(r != route for r, _ in after[other]), (name, after[other])
