"""Round trips of the kvstore and common converters, and their validation."""

import dataclasses
import random
import struct

import pytest

from pdd.core.block_hash import PromptChains
from pdd.core.cache_event import CacheEvent
from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.prefix_index.store import Hit
from pdd.wire import kvstore as conv
from pdd.wire.common import instance_ref_from_pb, instance_ref_to_pb, role_from_pb


@pytest.mark.parametrize("role", list(Role))
def test_instance_ref_round_trip(role):
    ref = InstanceRef("md-0", "10.0.0.7:50054", role, "remote")
    assert instance_ref_from_pb(instance_ref_to_pb(ref)) == ref


def test_instance_round_trip_through_wire_bytes():
    inst = Instance(
        InstanceRef("p-0", "127.0.0.1:1", Role.PREFILL), 16, "smollm2", InstanceLoad(1, 2, 3, 4), 99
    )
    msg = pb.InstanceInfo.FromString(conv.instance_to_pb(inst).SerializeToString())
    assert conv.load_from_pb(msg.load) == inst.load
    assert instance_ref_from_pb(msg.ref) == inst.ref
    assert (msg.block_size, msg.model, msg.last_heartbeat_ms) == (16, "smollm2", 99)


@pytest.mark.parametrize("kind", ["stored", "evicted", "cleared"])
def test_cache_event_round_trip(kind):
    hashes = () if kind == "cleared" else (2**64 - 1, 5, 0)
    ev = CacheEvent(kind=kind, block_hashes=hashes, parent_hash=2**63, salt="tenant", block_size=16)
    back = conv.cache_event_from_pb(
        pb.CacheEvent.FromString(conv.cache_event_to_pb(ev).SerializeToString()), 0, 16
    )
    assert (back.kind, back.block_hashes, back.parent_hash, back.salt) == (
        kind,
        hashes,
        2**63,
        "tenant",
    )


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.RegisterInstanceRequest(block_size=16, ttl_ms=1000), "ref.instance_id"),
        (
            pb.RegisterInstanceRequest(
                ref=common_pb2.InstanceRef(
                    instance_id="x", address="nohost", role=common_pb2.ROLE_PREFILL
                ),
                block_size=16,
                ttl_ms=1000,
            ),
            "ref.address",
        ),
        (
            pb.RegisterInstanceRequest(
                ref=common_pb2.InstanceRef(instance_id="x", address="h:1"),
                block_size=16,
                ttl_ms=1000,
            ),
            "ref.role",
        ),
        (
            pb.RegisterInstanceRequest(
                ref=common_pb2.InstanceRef(
                    instance_id="x", address="h:1", role=common_pb2.ROLE_RELAY
                ),
                ttl_ms=1000,
            ),
            "block_size",
        ),
        (
            pb.RegisterInstanceRequest(
                ref=common_pb2.InstanceRef(
                    instance_id="x", address="h:1", role=common_pb2.ROLE_RELAY
                ),
                block_size=16,
            ),
            "ttl_ms",
        ),
    ],
)
def test_register_validation_names_the_field(msg, field):
    with pytest.raises(InvalidArgumentError) as err:
        conv.register_from_pb(msg)
    assert err.value.field == field


def test_cache_event_validation():
    with pytest.raises(InvalidArgumentError, match=r"events\[3\]\.kind"):
        conv.cache_event_from_pb(pb.CacheEvent(), 3)
    with pytest.raises(InvalidArgumentError, match=r"events\[0\]\.block_hashes"):
        conv.cache_event_from_pb(pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_STORED), 0)


def test_predict_validation():
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
        conv.predict_from_pb(pb.PredictHitsRequest())
    with pytest.raises(InvalidArgumentError, match="role"):
        conv.predict_from_pb(pb.PredictHitsRequest(prompt_token_ids=[1], role=99))
    assert role_from_pb(common_pb2.ROLE_UNSPECIFIED, optional=True) is None


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_token_ids_packed_round_trip():
    rng = random.Random(7)
    tokens = [0, 2**32 - 1, *(rng.randrange(2**32) for _ in range(300))]
    packed = conv.token_ids_to_packed(tuple(tokens))
    assert packed == struct.pack(f"<{len(tokens)}I", *tokens)  # the wire's format, pinned
    assert conv.token_ids_from_packed(packed).tolist() == tokens
    got = conv.predict_from_pb(_wire(conv.predict_to_pb(tokens, "salt")))
    assert (got["prompt"].tolist(), got["salt"], got["instance_ids"], got["role"]) == (
        tokens,
        "salt",
        [],
        None,
    )
    # The repeated field (older clients): the same tokens.
    old = conv.predict_from_pb(_wire(pb.PredictHitsRequest(prompt_token_ids=tokens)))
    assert old["prompt"].tolist() == tokens
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
        conv.token_ids_to_packed([1, -1])
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids_packed"):
        conv.token_ids_from_packed(b"\0" * 5)


def test_prompt_chains_round_trip():
    tokens = list(range(50, 150))  # 100 tokens: partial tail blocks at 16 and 32
    chains = PromptChains.of(tokens, (16, 32, 128), "t")
    got = conv.predict_from_pb(_wire(conv.predict_to_pb(chains, "t")))
    assert got["prompt"] == chains and len(got["prompt"]) == 100
    assert got["prompt"].chains[128] == b""  # no full block: an empty chain, still one
    assert got["salt"] == "t"


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.PredictHitsRequest(), "prompt_token_ids"),
        (
            pb.PredictHitsRequest(prompt_token_ids=[1], prompt_token_ids_packed=b"\1\0\0\0"),
            "prompt_token_ids_packed",
        ),
        (
            pb.PredictHitsRequest(
                prompt_token_ids_packed=b"\1\0\0\0",
                prompt_chains=[pb.PromptChain(block_size=1, block_hashes_packed=b"\0" * 8)],
                prompt_tokens=1,
            ),
            "prompt_chains",
        ),
        (pb.PredictHitsRequest(prompt_token_ids_packed=b"\1\0\0"), "prompt_token_ids_packed"),
        (
            pb.PredictHitsRequest(prompt_token_ids_packed=b"\1\0\0\0", prompt_tokens=1),
            "prompt_tokens",
        ),
        (pb.PredictHitsRequest(prompt_chains=[pb.PromptChain(block_size=4)]), "prompt_tokens"),
        (
            pb.PredictHitsRequest(prompt_chains=[pb.PromptChain(block_size=0)], prompt_tokens=3),
            "prompt_chains[0].block_size",
        ),
        (
            pb.PredictHitsRequest(
                prompt_chains=[pb.PromptChain(block_size=4), pb.PromptChain(block_size=4)],
                prompt_tokens=3,
            ),
            "prompt_chains[1].block_size",
        ),
        (
            pb.PredictHitsRequest(
                prompt_chains=[pb.PromptChain(block_size=4, block_hashes_packed=b"\0" * 8)],
                prompt_tokens=12,
            ),
            "prompt_chains[0].block_hashes_packed",
        ),
        (
            pb.PredictHitsRequest(
                prompt_chains=[pb.PromptChain(block_size=bs) for bs in range(100, 100 + 17)],
                prompt_tokens=3,
            ),
            "prompt_chains",
        ),
    ],
)
def test_predict_prompt_validation_names_the_field(msg, field):
    with pytest.raises(InvalidArgumentError) as err:
        conv.predict_from_pb(msg)
    assert err.value.field == field


def test_hits_from_the_same_bytes_are_the_same_instance_and_still_validated():
    inst = Instance(InstanceRef("md-0", "127.0.0.1:1", Role.MAIN_DECODE), 16, "m", InstanceLoad())
    first = conv.hit_from_pb(_wire(conv.hit_to_pb(Hit(inst, 32, 0.5))), 0)
    again = conv.hit_from_pb(_wire(conv.hit_to_pb(Hit(inst, 16, 0.25))), 0)
    assert first == Hit(inst, 32, 0.5) and again == Hit(inst, 16, 0.25)
    assert again.instance is first.instance
    busier = dataclasses.replace(inst, load=InstanceLoad(running_requests=3))
    assert conv.hit_from_pb(conv.hit_to_pb(Hit(busier, 0, 0.0)), 0).instance == busier
    bad = conv.hit_to_pb(Hit(inst, 0, 0.0))
    bad.instance.ref.address = "nohost"
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match=r"hits\[3\]\.instance\.ref\.address"):
            conv.hit_from_pb(bad, 3)
