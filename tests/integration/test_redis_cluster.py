"""kvstore on a real three-node Redis Cluster on loopback (``redis+cluster://``): registration,
heartbeats, sequenced cache events, a gap, predictions and deregistration, over gRPC. Each
instance's keys share a hash tag (one slot), so no command crosses slots; the instances are
spread over the three nodes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdd.core.block_hash import chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.prefix_index.registry import InstanceRegistry
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.wire.kvstore_client import KvstoreClient
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build, connect_redis
from tests.conftest import free_port

pytestmark = pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("redis-cli")),
    reason="needs redis-server and redis-cli (apt's redis-server package)",
)


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("redis-cluster")
    ports = [_cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            d: Path = root / str(port)
            d.mkdir()
            cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            cmd += ["--save", "", "--appendonly", "no", "--dir", str(d)]
            log = open(d / "redis.log", "w")  # noqa: SIM115 — the child holds it
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        for port in ports:
            _wait(lambda p=port: _cli(p, "ping") == "PONG", f"PONG from :{port}")
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=60)
        _wait(
            lambda: all("cluster_state:ok" in _cli(p, "cluster", "info") for p in ports),
            "cluster_state:ok on every node",
        )
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000, Redis's fixed offset) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _cli(port: int, *args: str) -> str:
    try:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout.strip()


def _wait(ok, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis cluster: {what} not seen in {timeout_s:.0f} s")
        time.sleep(0.1)


@pytest.fixture
async def client(cluster_url, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5), redis_url=cluster_url, key_prefix=key_prefix
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield KvstoreClient(channel)
    await channel.close()
    await server.stop()


def _inst(instance_id: str) -> Instance:
    return Instance(InstanceRef(instance_id, "127.0.0.1:9", Role.MAIN_DECODE), 4, "m")


def _stored(tokens: list[int]) -> CacheEvent:
    return CacheEvent("stored", tuple(chain_hashes(tokens, 4)), 0, "", 4, tuple(tokens))


async def test_the_index_runs_on_a_three_node_redis_cluster(client, cluster_url, key_prefix):
    prompt = list(range(64))  # 16 blocks of 4
    ids = [f"md-{k}" for k in range(12)]
    for iid in ids:
        await client.register(_inst(iid), 60_000, reset_index=True)
    assert await client.heartbeat("md-0", InstanceLoad(running_requests=2))
    # md-k holds the first 4k tokens (md-0 nothing); events numbered from 1 after registration.
    for k, iid in enumerate(ids[1:], start=1):
        ack = await client.publish(iid, [_stored(prompt[: 4 * k])], first_seq=1)
        assert (ack.applied, ack.resync) == (1, False)
    hits = {h.instance.ref.instance_id: h.cached_tokens for h in await client.predict(prompt)}
    assert hits == {iid: 4 * k for k, iid in enumerate(ids)}
    assert {i.ref.instance_id for i in await client.list()} == set(ids)

    gap = await client.publish("md-3", [_stored(prompt)], first_seq=5)
    assert (gap.applied, gap.resync) == (0, True)

    # The keys really are spread: several nodes hold block sets, each beside its instance's record.
    redis = connect_redis(cluster_url, 2.0)
    await redis.initialize()
    try:
        registry = InstanceRegistry(redis, key_prefix)
        slots = {redis.keyslot(registry.blocks_key(i)) for i in ids}
        nodes = {redis.get_node_from_key(registry.blocks_key(i)).name for i in ids}
        assert len(nodes) >= 2 and len(slots) >= 2
        for iid in ids:
            assert redis.keyslot(registry.instance_key(iid)) == redis.keyslot(
                registry.blocks_key(iid)
            )
    finally:
        await redis.aclose()

    await client.deregister("md-5")
    hits = {h.instance.ref.instance_id: h.cached_tokens for h in await client.predict(prompt)}
    assert "md-5" not in hits and hits["md-11"] == 44

    # A second kvstore on the cluster (a replica, its own view): what it deregisters, and a
    # prefix evicted meanwhile, are in the first one's next answer (searched from remembered runs).
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5), redis_url=cluster_url, key_prefix=key_prefix
    )
    other = GrpcServer(config.server, build(config))
    port = await other.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        replica = KvstoreClient(channel)
        await replica.deregister("md-7")
        chain = chain_hashes(prompt, 4)
        await replica.publish("md-11", [CacheEvent("evicted", (chain[6],), chain[5], "", 4)])
        hits = {h.instance.ref.instance_id: h.cached_tokens for h in await client.predict(prompt)}
        want = {iid: 4 * k for k, iid in enumerate(ids) if iid not in ("md-5", "md-7")}
        assert hits == {**want, "md-11": 24}
    finally:
        await channel.close()
        await other.stop()
