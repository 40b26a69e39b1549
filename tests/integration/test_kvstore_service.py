"""kvstore over a real gRPC port and a real Redis: registry, index, predictions, errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdd.core.block_hash import PromptChains, chain_hashes
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from pdd.wire import kvstore as kv_conv
from pdd.wire.kvstore_client import KvstoreClient
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build


@pytest.fixture
async def stub(redis_url, key_prefix):
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5), redis_url=redis_url, key_prefix=key_prefix
    )
    server = GrpcServer(config.server, build(config))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.KvstoreServiceStub(channel), channel
    await channel.close()
    await server.stop()


def _ref(instance_id: str, role: int, cluster: str = "main") -> common_pb2.InstanceRef:
    return common_pb2.InstanceRef(
        instance_id=instance_id, address="127.0.0.1:9", role=role, cluster=cluster
    )


async def _register(s, instance_id, role, block_size=4, ttl_ms=60_000):
    await s.RegisterInstance(
        pb.RegisterInstanceRequest(
            ref=_ref(instance_id, role), block_size=block_size, ttl_ms=ttl_ms, model="tiny"
        )
    )


async def test_health_is_serving(stub):
    _, channel = stub
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "pdd.kvstore.v1.KvstoreService"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_register_list_and_filter_by_role(stub):
    s, _ = stub
    await _register(s, "p-0", common_pb2.ROLE_PREFILL)
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE)
    all_ = await s.ListInstances(pb.ListInstancesRequest())
    assert sorted(i.ref.instance_id for i in all_.instances) == ["md-0", "p-0"]
    md = await s.ListInstances(pb.ListInstancesRequest(role=common_pb2.ROLE_MAIN_DECODE))
    assert [i.ref.instance_id for i in md.instances] == ["md-0"]
    assert md.instances[0].block_size == 4 and md.instances[0].last_heartbeat_ms > 0


async def test_predict_counts_leading_cached_blocks_per_instance(stub):
    s, _ = stub
    await _register(s, "p-0", common_pb2.ROLE_PREFILL, block_size=4)
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE, block_size=8)
    prompt = list(range(100, 140))  # 40 tokens
    p_hashes = chain_hashes(prompt, 4)
    md_hashes = chain_hashes(prompt, 8)
    # p-0 holds the first 5 blocks (20 tokens); md-0 holds blocks 0,1 and 3 — only 2 lead.
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="p-0",
            events=[pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_STORED, block_hashes=p_hashes[:5])],
        )
    )
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="md-0",
            events=[
                pb.CacheEvent(
                    kind=pb.CACHE_EVENT_KIND_STORED,
                    block_hashes=[md_hashes[0], md_hashes[1], md_hashes[3]],
                )
            ],
        )
    )
    resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
    got = {h.instance.ref.instance_id: (h.cached_tokens, round(h.hit_rate, 4)) for h in resp.hits}
    assert got == {"p-0": (20, round(20 / 40, 4)), "md-0": (16, round(16 / 40, 4))}

    # Eviction of p-0's third block cuts its leading run to 2 blocks.
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="p-0",
            events=[pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_EVICTED, block_hashes=[p_hashes[2]])],
        )
    )
    resp = await s.PredictHits(
        pb.PredictHitsRequest(prompt_token_ids=prompt, role=common_pb2.ROLE_PREFILL)
    )
    assert [(h.instance.ref.instance_id, h.cached_tokens) for h in resp.hits] == [("p-0", 8)]

    # A different salt sees nothing; a cleared instance holds nothing.
    resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt, cache_salt="other"))
    assert all(h.cached_tokens == 0 for h in resp.hits)
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="md-0", events=[pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_CLEARED)]
        )
    )
    resp = await s.PredictHits(
        pb.PredictHitsRequest(prompt_token_ids=prompt, instance_ids=["md-0"])
    )
    assert [(h.instance.ref.instance_id, h.cached_tokens) for h in resp.hits] == [("md-0", 0)]


async def test_lease_expires_without_heartbeat_and_heartbeat_renews(stub):
    s, _ = stub
    # NOTE: heartbeats 4x as often as the lease lasts, so a stall of a loaded machine cannot expire rld-1.
    await _register(s, "rld-0", common_pb2.ROLE_RELAY, ttl_ms=800)
    await _register(s, "rld-1", common_pb2.ROLE_RELAY, ttl_ms=800)
    for _ in range(6):
        await asyncio.sleep(0.2)
        assert (
            await s.Heartbeat(
                pb.HeartbeatRequest(instance_id="rld-1", load=pb.InstanceLoad(running_requests=3))
            )
        ).known
    listed = await s.ListInstances(pb.ListInstancesRequest(role=common_pb2.ROLE_RELAY))
    assert [(i.ref.instance_id, i.load.running_requests) for i in listed.instances] == [
        ("rld-1", 3)
    ]
    assert not (await s.Heartbeat(pb.HeartbeatRequest(instance_id="rld-0"))).known


async def test_deregister_drops_instance_and_its_blocks(stub):
    s, _ = stub
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE)
    prompt = list(range(8))
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="md-0",
            events=[
                pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_STORED, block_hashes=chain_hashes(prompt, 4))
            ],
        )
    )
    await s.DeregisterInstance(pb.DeregisterInstanceRequest(instance_id="md-0"))
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE)
    resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
    assert [h.cached_tokens for h in resp.hits] == [0]


@pytest.mark.parametrize(
    ("rpc", "request_", "field"),
    [
        ("PredictHits", pb.PredictHitsRequest(), "prompt_token_ids"),
        (
            "RegisterInstance",
            pb.RegisterInstanceRequest(block_size=4, ttl_ms=10),
            "ref.instance_id",
        ),
        ("Heartbeat", pb.HeartbeatRequest(), "instance_id"),
        (
            "PublishCacheEvents",
            pb.PublishCacheEventsRequest(instance_id="x", events=[pb.CacheEvent()]),
            "events[0].kind",
        ),
        ("ListInstances", pb.ListInstancesRequest(role=42), "role"),
    ],
)
async def test_malformed_requests_are_invalid_argument_naming_the_field(stub, rpc, request_, field):
    s, _ = stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(s, rpc)(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":")
    # and the server keeps serving
    assert (await s.ListInstances(pb.ListInstancesRequest())) is not None


async def test_events_for_an_unregistered_instance_are_not_found(stub):
    s, _ = stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.PublishCacheEvents(
            pb.PublishCacheEventsRequest(
                instance_id="ghost", events=[pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_CLEARED)]
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "ghost" in err.value.details()


async def test_a_kvstore_never_predicts_an_instance_another_kvstore_deregistered(
    stub, redis_url, key_prefix
):
    """Two kvstores on one Redis (replicas): each keeps its own view of the registry, and an
    instance deregistered through one is never in the other's next answer."""
    s, _ = stub
    config = KvstoreConfig(
        server=ServerConfig(port=0, grace_s=0.5), redis_url=redis_url, key_prefix=key_prefix
    )
    other = GrpcServer(config.server, build(config))
    port = await other.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        s2 = pb_grpc.KvstoreServiceStub(channel)
        prompt = list(range(8))
        for iid in ("md-0", "md-1"):
            await _register(s, iid, common_pb2.ROLE_MAIN_DECODE)
            await s.PublishCacheEvents(
                pb.PublishCacheEventsRequest(
                    instance_id=iid,
                    events=[
                        pb.CacheEvent(
                            kind=pb.CACHE_EVENT_KIND_STORED, block_hashes=chain_hashes(prompt, 4)
                        )
                    ],
                )
            )
        resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
        assert {h.instance.ref.instance_id: h.cached_tokens for h in resp.hits} == {
            "md-0": 8,
            "md-1": 8,
        }
        await s2.DeregisterInstance(pb.DeregisterInstanceRequest(instance_id="md-1"))
        resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
        assert [(h.instance.ref.instance_id, h.cached_tokens) for h in resp.hits] == [("md-0", 8)]
    finally:
        await channel.close()
        await other.stop()


async def test_token_ids_cover_the_whole_uint32_range(stub):
    """The request's token ids reach the hash as sent, up to 2**32 - 1 (no int32 wrap)."""
    s, _ = stub
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE)
    prompt = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 7, 150_000, 2**32 - 2] * 512  # 1,024 blocks
    await s.PublishCacheEvents(
        pb.PublishCacheEventsRequest(
            instance_id="md-0",
            events=[
                pb.CacheEvent(
                    kind=pb.CACHE_EVENT_KIND_STORED, block_hashes=chain_hashes(prompt, 4)[:1000]
                )
            ],
        )
    )
    resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
    assert [h.cached_tokens for h in resp.hits] == [4000]


async def test_each_answer_carries_the_load_of_the_last_heartbeat(stub):
    """Records are read with every prediction, and each answer's instance message is its record
    now (built once per record version, never kept past a change)."""
    s, _ = stub
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE)
    prompt = list(range(8))
    for running in (0, 0, 5, 5, 2):
        if running:
            load = pb.InstanceLoad(running_requests=running, kv_blocks_total=100)
            assert (await s.Heartbeat(pb.HeartbeatRequest(instance_id="md-0", load=load))).known
        resp = await s.PredictHits(pb.PredictHitsRequest(prompt_token_ids=prompt))
        [hit] = resp.hits
        assert (hit.instance.ref.instance_id, hit.instance.load.running_requests) == (
            "md-0",
            running,
        )
        assert hit.instance.block_size == 4 and hit.instance.model == "tiny"


async def test_the_prompt_in_each_of_its_forms_gets_the_same_answer(stub):
    """The repeated field (older clients), the packed token ids and the gateway's chains: one
    answer. Chains lacking a live instance's block size fail FAILED_PRECONDITION, and the typed
    client then sends the token ids."""
    s, channel = stub
    await _register(s, "p-0", common_pb2.ROLE_PREFILL, block_size=4)
    await _register(s, "md-0", common_pb2.ROLE_MAIN_DECODE, block_size=8)
    prompt = list(range(7, 7 + 43))  # 43 tokens: a partial tail block at both sizes
    for iid, bs, held in (("p-0", 4, 6), ("md-0", 8, 3)):
        await s.PublishCacheEvents(
            pb.PublishCacheEventsRequest(
                instance_id=iid,
                events=[
                    pb.CacheEvent(
                        kind=pb.CACHE_EVENT_KIND_STORED,
                        block_hashes=chain_hashes(prompt, bs, "t")[:held],
                        cache_salt="t",
                    )
                ],
            )
        )
    want = {"p-0": 24, "md-0": 24}
    chains = PromptChains.of(prompt, (4, 8), "t")
    forms = [
        pb.PredictHitsRequest(prompt_token_ids=prompt, cache_salt="t"),
        kv_conv.predict_to_pb(prompt, "t"),
        kv_conv.predict_to_pb(chains, "t"),
    ]
    assert [len(f.prompt_token_ids_packed) for f in forms] == [0, 4 * 43, 0]
    for msg in forms:
        resp = await s.PredictHits(msg)
        assert {h.instance.ref.instance_id: h.cached_tokens for h in resp.hits} == want
        assert {round(h.hit_rate, 4) for h in resp.hits} == {round(24 / 43, 4)}

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.PredictHits(kv_conv.predict_to_pb(PromptChains.of(prompt, (4,), "t"), "t"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block size 8" in err.value.details()
    # Only prefill searched: the chain at 4 is enough.
    resp = await s.PredictHits(
        pb.PredictHitsRequest(
            prompt_chains=[pb.PromptChain(block_size=4, block_hashes_packed=chains.chains[4])],
            prompt_tokens=43,
            role=common_pb2.ROLE_PREFILL,
        )
    )
    assert [(h.instance.ref.instance_id, h.cached_tokens) for h in resp.hits] == [("p-0", 24)]

    client = KvstoreClient(channel)
    for sizes in ((), (4, 8), (4,), (16,)):
        hits = await client.predict(tuple(prompt), "t", block_sizes=sizes)
        assert {h.instance.ref.instance_id: h.cached_tokens for h in hits} == want, sizes


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            pb.PredictHitsRequest(prompt_token_ids=[1], prompt_token_ids_packed=b"\0" * 4),
            "prompt_token_ids_packed",
        ),
        (pb.PredictHitsRequest(prompt_token_ids_packed=b"\0" * 6), "prompt_token_ids_packed"),
        (pb.PredictHitsRequest(prompt_token_ids=[1], prompt_tokens=1), "prompt_tokens"),
        (
            pb.PredictHitsRequest(
                prompt_chains=[pb.PromptChain(block_size=4, block_hashes_packed=b"\0" * 8)]
            ),
            "prompt_tokens",
        ),
        (
            pb.PredictHitsRequest(
                prompt_chains=[pb.PromptChain(block_size=4, block_hashes_packed=b"\0" * 8)],
                prompt_tokens=9,
            ),
            "prompt_chains[0].block_hashes_packed",
        ),
    ],
)
async def test_a_malformed_prompt_is_invalid_argument_naming_its_field(stub, request_, field):
    s, _ = stub
    await _register(s, "p-0", common_pb2.ROLE_PREFILL, block_size=4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.PredictHits(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
