"""The simulator's clock and its WAN link model (pure Python, no I/O).

``EventLoop`` is a heap of (time, seq, callback); time is seconds.

``SimLink`` is one WAN link as the report describes it: a bounded pool of
concurrent KV streams (the "connection pool") sharing the link's bandwidth
equally (processor sharing), each optionally capped; transfers beyond the pool
wait in a queue. With ``priority`` the queue serves urgent transfers (KV a user
is waiting for: P-MD) before background ones (P-RLD-MD, whose latency the relay
hides), and ``reserved`` streams are kept for urgent transfers only, so a
burst of large background deltas cannot hold the whole pool. Every finished
transfer reports its queueing and in-flight seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass
class _Transfer:
    remaining: float
    submitted: float
    done: Callable[[float, float], None]
    urgent: bool = True
    started: float = 0.0


class SimLink:
    def __init__(
        self,
        loop: EventLoop,
        bytes_per_s: float,
        streams: int,
        stream_cap_bps: float = 0.0,
        priority: bool = False,
        reserved: int = 0,
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s: must be > 0, got {bytes_per_s}")
        if streams < 1:
            raise ValueError(f"streams: must be >= 1, got {streams}")
        if not 0 <= reserved < streams:
            raise ValueError(f"reserved: must be in [0, streams), got {reserved}")
        self.loop, self.bytes_per_s, self.streams = loop, bytes_per_s, streams
        self.stream_cap = stream_cap_bps / 8 if stream_cap_bps > 0 else float("inf")
        self.priority = priority
        self.reserved = reserved if priority else 0
        self.active: list[_Transfer] = []
        self.urgent: deque[_Transfer] = deque()
        self.background: deque[_Transfer] = deque()
        self._last = 0.0
        self._version = 0
        # Time during which every stream of the pool was busy (pool saturation).
        self.saturated_s = 0.0
        # What the live prefill's ``LinkMeter`` reports to the router: bytes moved per second of
        # time with a transfer in flight, and the bytes of open pushes not yet across.
        self.busy_s = 0.0
        self.moved = 0.0
        self.outstanding = 0.0

    def sync(self) -> None:
        """Bring the busy-time counters up to now (between events)."""
        self._advance()

    @property
    def measured_bps(self) -> float:
        """Bytes per second of busy time so far (0: nothing sent yet), as ``LinkMeter`` measures."""
        return self.moved / self.busy_s if self.busy_s > 0 else 0.0

    def _rate(self) -> float:
        return min(self.bytes_per_s / len(self.active), self.stream_cap) if self.active else 0.0

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        if self.active and dt > 0:
            sent = self._rate() * dt
            for t in self.active:
                t.remaining -= sent
            self.busy_s += dt
            self.moved += sent * len(self.active)
            if len(self.active) == self.streams:
                self.saturated_s += dt
        self._last = now

    def submit(
        self, nbytes: float, done: Callable[[float, float], None], urgent: bool = True
    ) -> None:
        """Send ``nbytes``; ``done(queue_s, flight_s)`` is called when the last byte lands."""
        self._advance()
        urgent = urgent or not self.priority
        t = _Transfer(remaining=float(nbytes), submitted=self.loop.now, done=done, urgent=urgent)
        (self.urgent if urgent else self.background).append(t)
        self._admit()
        self._reschedule()

    def _admit(self) -> None:
        while len(self.active) < self.streams and (self.urgent or self.background):
            if not self.urgent and self._background_active() >= self.streams - self.reserved:
                return
            t = (self.urgent or self.background).popleft()
            t.started = self.loop.now
            self.active.append(t)

    def _background_active(self) -> int:
        return sum(not t.urgent for t in self.active)

    def _reschedule(self) -> None:
        self._version += 1
        if self.active:
            version = self._version
            eta = min(t.remaining for t in self.active) / self._rate()
            self.loop.at(self.loop.now + max(0.0, eta), lambda: self._complete(version))

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = [t for t in self.active if t.remaining <= 1.0]
        self.active = [t for t in self.active if t.remaining > 1.0]
        self._admit()
        self._reschedule()
        for t in finished:
            t.done(t.started - t.submitted, self.loop.now - t.started)
