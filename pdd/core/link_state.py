"""One WAN link's measured state, as its sender (prefill) sees it.

A link leads from prefill's cluster to one remote cluster of MainDecodes; prefill meters it where
the KV is sent (``pdd.kv.link_meter``), publishes one ``LinkState`` per remote cluster with its
load report (membership → kvstore → the instance's ``InstanceLoad.links``), and the router reads
it to estimate how long a KV delta would take to cross (``pdd.routing.policy``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkState:
    # The remote cluster the link leads to (``InstanceRef.cluster`` of its MainDecodes).
    cluster: str
    # Bytes per second of push time achieved recently; 0: not measured yet.
    throughput_bps: float = 0.0
    # KV bytes of pushes waiting for a slot of the link's stream pool.
    queued_bytes: int = 0
    # Bytes of pushes in progress not yet sent.
    in_flight_bytes: int = 0
    # Round trip over the link itself (a tiny call through the same path); 0: not measured yet.
    rtt_s: float = 0.0
    # Milliseconds since the Unix epoch of the measurement (the queue's snapshot: when the state
    # was read for a load report).
    measured_at_ms: int = 0
    # False after consecutive push failures, or when no RTT answer came within its deadline.
    healthy: bool = True

    def __post_init__(self) -> None:
        if not self.cluster:
            raise ValueError("cluster: must not be empty")
        if not (math.isfinite(self.throughput_bps) and self.throughput_bps >= 0):
            raise ValueError(f"throughput_bps: must be finite and >= 0, got {self.throughput_bps}")
        if self.queued_bytes < 0:
            raise ValueError(f"queued_bytes: must be >= 0, got {self.queued_bytes}")
        if self.in_flight_bytes < 0:
            raise ValueError(f"in_flight_bytes: must be >= 0, got {self.in_flight_bytes}")
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ValueError(f"rtt_s: must be finite and >= 0, got {self.rtt_s}")
        if self.measured_at_ms < 0:
            raise ValueError(f"measured_at_ms: must be >= 0, got {self.measured_at_ms}")

    @property
    def measured(self) -> bool:
        """Whether a throughput was measured (the router's estimate needs one)."""
        return self.throughput_bps > 0

    def bytes_ahead(self, now_ms: int | None = None) -> float:
        """Bytes queued and in flight, as reported, less what the link has carried since the
        report at its measured throughput: a report is seconds old when the router reads it
        (one heartbeat), and what was on the wire then has mostly crossed."""
        ahead = float(self.queued_bytes + self.in_flight_bytes)
        if now_ms is not None and self.measured_at_ms and self.measured:
            age_s = max(0, now_ms - self.measured_at_ms) / 1000
            ahead = max(0.0, ahead - self.throughput_bps * age_s)
        return ahead

    def transfer_s(
        self, delta_bytes: int, now_ms: int | None = None, known_ahead: int = 0
    ) -> float:
        """Estimated seconds until ``delta_bytes`` pushed now have crossed: the bytes ahead of it,
        then its own, at the measured throughput, plus one round trip. Bytes ahead: the report's,
        drained since ``now_ms`` (``bytes_ahead``), or ``known_ahead`` — what the caller itself
        sent onto the link and has not seen cross — when that is more."""
        if not self.measured:
            raise ValueError(f"throughput_bps: link to {self.cluster!r} is not measured yet")
        ahead = max(self.bytes_ahead(now_ms), float(known_ahead))
        return (ahead + delta_bytes) / self.throughput_bps + self.rtt_s
