"""Serving instances as plain data: who they are, where they listen, how loaded.

Shared by the prefix index (kvstore), the router (pure policy) and the
gateway; no gRPC or Redis here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdd.core.link_state import LinkState


class Role(enum.Enum):
    PREFILL = "prefill"
    RELAY = "relay"
    MAIN_DECODE = "main_decode"


@dataclass(frozen=True)
class InstanceRef:
    instance_id: str
    # host:port of the instance's gRPC server.
    address: str
    role: Role
    # The cluster it sits in, e.g. "main" (beside prefill) or "remote".
    cluster: str = "main"

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id: must not be empty")
        if ":" not in self.address:
            raise ValueError(f"address: expected host:port, got {self.address!r}")


@dataclass(frozen=True)
class InstanceLoad:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Prefill only: the measured state of each WAN link it pushes over, one per remote cluster.
    links: tuple[LinkState, ...] = ()

    def link(self, cluster: str) -> LinkState | None:
        """The state of the link to ``cluster``, if this instance reported one."""
        return next((lk for lk in self.links if lk.cluster == cluster), None)


@dataclass(frozen=True)
class Instance:
    ref: InstanceRef
    block_size: int
    model: str = ""
    load: InstanceLoad = field(default_factory=InstanceLoad)
    last_heartbeat_ms: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
