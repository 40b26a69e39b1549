"""Round trips of the kvstore and common converters, and their validation."""

import pytest

from pdd.core.cache_event import CacheEvent
from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
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
