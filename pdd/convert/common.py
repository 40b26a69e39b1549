"""Converters for ``pdd.common.v1`` messages."""

from __future__ import annotations

from pdd.errors import InvalidArgumentError
from pdd.gen.common.v1 import common_pb2
from pdd.instance import InstanceRef, Role

_ROLE_TO_PB = {
    Role.PREFILL: common_pb2.ROLE_PREFILL,
    Role.RELAY: common_pb2.ROLE_RELAY,
    Role.MAIN_DECODE: common_pb2.ROLE_MAIN_DECODE,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def role_to_pb(role: Role) -> int:
    return _ROLE_TO_PB[role]


def role_from_pb(value: int, field: str = "role", *, optional: bool = False) -> Role | None:
    if value == common_pb2.ROLE_UNSPECIFIED and optional:
        return None
    try:
        return _ROLE_FROM_PB[value]
    except KeyError:
        raise InvalidArgumentError(field, f"must be one of {sorted(r.value for r in Role)}") from None


def instance_ref_to_pb(ref: InstanceRef) -> common_pb2.InstanceRef:
    return common_pb2.InstanceRef(instance_id=ref.instance_id, address=ref.address,
                                  role=role_to_pb(ref.role), cluster=ref.cluster)


def instance_ref_from_pb(msg: common_pb2.InstanceRef, field: str = "ref") -> InstanceRef:
    if not msg.instance_id:
        raise InvalidArgumentError(f"{field}.instance_id", "must not be empty")
    host, sep, port = msg.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"{field}.address", f"expected host:port, got {msg.address!r}")
    role = role_from_pb(msg.role, f"{field}.role")
    assert role is not None
    return InstanceRef(msg.instance_id, msg.address, role, msg.cluster or "main")
