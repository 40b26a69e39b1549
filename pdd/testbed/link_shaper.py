"""The emulated wire of one link direction: shared bandwidth, delay, jitter, stalls.

Each TCP connection through the emulator has two ``Flow`` s (one per
direction). A ``LinkDirection`` owns the bandwidth of its direction and runs
one scheduler over all its flows:

1. a flow's reader appends what it read from its socket to ``pending``
   (bounded: a full flow stops reading, so the sender's TCP window closes —
   back-pressure, like a full NIC queue);
2. the scheduler visits flows round-robin and admits one quantum (about a
   millisecond of link time) from each flow that has data — equal quanta make
   the connections share the link fairly;
3. admission is paced by a virtual clock: a quantum of n bytes occupies the
   wire for n / rate seconds (a token bucket whose depth is one burst); no
   quantum starts inside a stall window;
4. the quantum is released to the far end at (end of its transmission) +
   one-way delay + a random jitter, but never before the flow's previous
   quantum — jitter delays, it does not reorder a TCP byte stream.

NOTE: release times use asyncio timers, which fire up to ~1 ms late (epoll's
millisecond granularity); the delay is a lower bound, never early.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque

_EOF = None


class Flow:
    """One direction of one connection."""

    def __init__(self, link: LinkDirection, max_pending: int) -> None:
        self._link = link
        self._max_pending = max_pending
        self._pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self._eof = False
        self._room = asyncio.Event()
        self._room.set()
        # (release time, bytes or None for EOF), release times non-decreasing.
        self.in_flight: deque[tuple[float, bytes | None]] = deque()
        self.arrived = asyncio.Event()
        self.last_release = 0.0

    async def put(self, data: bytes) -> None:
        """Queue bytes read from the socket; waits while the flow is full."""
        await self._room.wait()
        self._pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= self._max_pending:
            self._room.clear()
        self._link.wake()

    def put_eof(self) -> None:
        self._eof = True
        self._link.wake()

    @property
    def ready(self) -> bool:
        return bool(self._pending) or self._eof

    def take(self, quantum: int) -> bytes | None:
        """Up to ``quantum`` pending bytes, or ``None`` (EOF) once everything before it was taken."""
        if not self._pending:
            self._eof = False  # EOF is handed out exactly once
            return _EOF
        parts, size = [], 0
        while self._pending and size < quantum:
            head = self._pending[0]
            room = quantum - size
            if len(head) <= room:
                parts.append(self._pending.popleft())
                size += len(head)
            else:
                parts.append(head[:room])
                self._pending[0] = head[room:]
                size += room
        self.pending_bytes -= size
        if self.pending_bytes < self._max_pending:
            self._room.set()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self, at: float, data: bytes | None) -> None:
        at = max(at, self.last_release)  # NOTE: never reorder within a connection
        self.last_release = at
        self.in_flight.append((at, data))
        self.arrived.set()


class LinkDirection:
    """Bandwidth, delay and stalls of one direction, shared by every flow."""

    def __init__(
        self,
        *,
        bytes_per_s: float,
        delay_s: float,
        jitter_s: float,
        stall_every_s: float,
        stall_s: float,
        quantum: int,
        burst_bytes: int,
        rng: random.Random,
    ) -> None:
        self._bps = bytes_per_s  # 0: unlimited
        self._delay = delay_s
        self._jitter = jitter_s
        self._stall_every = stall_every_s
        self._stall = stall_s
        self.quantum = quantum
        self._burst_s = burst_bytes / bytes_per_s if bytes_per_s else 0.0
        self._rng = rng
        self._flows: list[Flow] = []
        self._cursor = 0
        self._work = asyncio.Event()
        self._next_t = 0.0
        self._t0 = 0.0

    def add(self, flow: Flow) -> None:
        self._flows.append(flow)

    def remove(self, flow: Flow) -> None:
        if flow in self._flows:
            self._flows.remove(flow)

    def wake(self) -> None:
        self._work.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._t0 = self._next_t = loop.time()
        while True:
            flow = self._next_ready()
            if flow is None:
                self._work.clear()
                await self._work.wait()
                continue
            data = flow.take(self.quantum)
            if data is _EOF:
                flow.release(loop.time() + self._delay, _EOF)
                continue
            sent_at = await self._admit(len(data), loop)
            jitter = self._rng.uniform(0.0, self._jitter) if self._jitter else 0.0
            flow.release(sent_at + self._delay + jitter, data)

    def _next_ready(self) -> Flow | None:
        n = len(self._flows)
        for step in range(n):
            flow = self._flows[(self._cursor + step) % n]
            if flow.ready:
                self._cursor = (self._cursor + step + 1) % n
                return flow
        return None

    async def _admit(self, size: int, loop: asyncio.AbstractEventLoop) -> float:
        """Wait for the wire; returns when the quantum's last byte has left."""
        now = loop.time()
        if not self._bps:
            start = self._after_stall(now)
            if start > now:
                await asyncio.sleep(start - now)
            return start
        # Idle time earns at most one burst of credit.
        start = self._after_stall(max(self._next_t, now - self._burst_s))
        self._next_t = start + size / self._bps
        if start > now:
            await asyncio.sleep(start - now)
        return max(self._next_t, now)  # burst credit never makes a release early

    def _after_stall(self, t: float) -> float:
        """``t``, or the end of the stall window it falls in (windows open every period, from the second)."""
        if not self._stall_every or not self._stall:
            return t
        k = math.floor((t - self._t0) / self._stall_every)
        window = self._t0 + k * self._stall_every
        return window + self._stall if k >= 1 and t < window + self._stall else t
