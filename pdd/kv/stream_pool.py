"""The report's "connection pool": at most K concurrent KV pushes per WAN link.

Each push holds one slot for its whole life (retries included); the others
wait in FIFO order and the time each one waited is measured — the report's
queueing delay that dominates uniform-hit workloads.

NOTE: a slot is handed directly from the releasing push to the oldest waiter,
so a newcomer can never overtake the queue; a waiter cancelled while queued
(or just after being handed a slot) passes its slot on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StreamPool:
    def __init__(self, limit: int, *, name: str = "wan") -> None:
        if limit <= 0:
            raise ValueError(f"limit: must be positive, got {limit}")
        self.limit = limit
        self.name = name
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.peak_in_use = 0
        self.acquired = 0
        self.total_wait_s = 0.0
        self.max_wait_s = 0.0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a slot for the ``async with`` body; yields the seconds spent queued."""
        waited = await self._acquire()
        try:
            yield waited
        finally:
            self._release()

    async def _acquire(self) -> float:
        start = time.monotonic()
        if self._in_use < self.limit and not self._waiters:
            self._in_use += 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut  # resolved by _release, which already counted us in
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()  # handed a slot just as we were cancelled: pass it on
                elif fut in self._waiters:
                    self._waiters.remove(fut)
                raise
        waited = time.monotonic() - start
        self.acquired += 1
        self.total_wait_s += waited
        self.max_wait_s = max(self.max_wait_s, waited)
        self.peak_in_use = max(self.peak_in_use, self._in_use)
        return waited

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; _in_use unchanged
                return
        self._in_use -= 1
