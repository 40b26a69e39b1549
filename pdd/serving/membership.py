"""An instance's membership in the stack: lease, load reports, cache events.

Life: ``start()`` registers the instance with kvstore (resetting its old
index entries — a restarted instance holds no KV) → a background task
heartbeats every ttl/3 with the current load (prefill's includes its WAN links' measured
state, ``InstanceLoad.links``: the router reads it), re-registering and
republishing its whole cache if the lease had lapsed, or once a batch of cache events could
not be delivered (a gap in what kvstore saw) → cache events from the
engine are queued by ``publish`` and sent in order, batched, by a second
task → ``stop()`` deregisters.

Re-registration (lease lapsed, so kvstore dropped the instance and its block
index): register again with ``reset_index`` → take the cache ``snapshot``
(async: the engine's cache is read on the engine thread) → queue its
"stored" events → then the live events published while it was being taken.

NOTE: events are set assignments per block hash (stored: present; evicted or
cleared: absent) and the snapshot is the result of every event emitted
before it was read, so those may reach the reset index on either side of
it: replaying a tail of them after the snapshot changes nothing. An event
emitted *after* the read must never precede the snapshot (an "evicted" would
be undone by its "stored"), which is why events published while it is
taken wait behind it.

Sequence numbers: each batch carries the number of its first event (``first_seq``), counted from 1
at every registration with a reset index; kvstore refuses a batch past the next number it expects
(events were lost: a batch given up on, or one kvstore never saw) and answers ``resync``, which
triggers the same re-registration + snapshot at once (``resyncs`` counts them all). A retried
batch kvstore already applied is not applied twice. NOTE: registration and publishing take turns
(``_wire``), so a batch is never numbered against a registration it was not sent under.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from pdd.core.cache_event import CacheEvent, PublishResult
from pdd.core.errors import PddError
from pdd.core.instance import Instance, InstanceLoad

log = structlog.get_logger(__name__)

# An instance's lease by default, and how many load reports it sends within one.
DEFAULT_LEASE_TTL_MS = 6000
HEARTBEATS_PER_LEASE = 3

MAX_EVENTS_PER_CALL = 256

# The cache's whole content as "stored" events (see ``RadixCache.snapshot_events``).
Snapshot = Callable[[], Awaitable[list[CacheEvent]]]


class Kvstore(Protocol):
    """What membership asks of kvstore: ``pdd.wire.kvstore_client.KvstoreClient`` over gRPC
    (its failures are ``PeerError``), or the domain itself (``PrefixStore``) in-process (its
    failures are the other ``PddError``s): either is survived and retried, never fatal."""

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None: ...

    async def heartbeat(self, instance_id: str, load: InstanceLoad) -> bool: ...

    async def deregister(self, instance_id: str) -> object: ...

    async def publish(
        self, instance_id: str, events: Sequence[CacheEvent], *, first_seq: int = 0
    ) -> PublishResult | int: ...


async def _no_cache() -> list[CacheEvent]:
    return []


class Membership:
    def __init__(
        self,
        kvstore: Kvstore,
        instance: Instance,
        *,
        ttl_ms: int = 6000,
        load: Callable[[], InstanceLoad] = InstanceLoad,
        snapshot: Snapshot = _no_cache,
    ) -> None:
        """``kvstore``: its channel (and TLS) belong to the caller, who closes it after ``stop``."""
        self.kvstore = kvstore
        self.instance = instance
        self.ttl_ms = ttl_ms
        self._load = load
        self._snapshot = snapshot
        self._events: asyncio.Queue[CacheEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        # Live events published while a snapshot is being taken; queued after it (see module NOTE).
        self._held: list[CacheEvent] | None = None
        # Set when the lease lapsed and the index is not rebuilt yet (a failed snapshot retries).
        self._resync_pending = False
        self.published = 0
        self.resyncs = 0
        # Sequence number of the next event sent; 1 after each registration with a reset index.
        self._next_seq = 1
        self._wire = asyncio.Lock()
        # Set when kvstore asked for a resync: the heartbeat task does it now, not a period later.
        self._wake = asyncio.Event()
        # Resyncs kvstore asked for (a gap it saw in the event sequence).
        self.gaps = 0

    @property
    def instance_id(self) -> str:
        return self.instance.ref.instance_id

    async def start(self) -> None:
        await self._register(reset_index=True)
        self._tasks = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._publisher()),
        ]

    async def stop(self) -> None:
        await self.flush(timeout=2.0)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.kvstore.deregister(self.instance_id), 2.0)
        except (PddError, TimeoutError) as exc:
            log.warning("deregister_failed", error=str(exc) or "timed out")

    def publish(self, event: CacheEvent) -> None:
        """Queue one cache event (call on the event loop thread)."""
        if self._held is not None:
            self._held.append(event)
        else:
            self._events.put_nowait(event)

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued event was sent (tests, shutdown)."""
        try:
            await asyncio.wait_for(self._events.join(), timeout)
        except TimeoutError:
            log.warning("cache_event_flush_timeout", pending=self._events.qsize())

    async def _register(self, *, reset_index: bool) -> None:
        async with self._wire:
            register = self.kvstore.register(self.instance, self.ttl_ms, reset_index=reset_index)
            await asyncio.wait_for(register, 5.0)
            if reset_index:
                self._next_seq = 1

    async def _heartbeat(self) -> None:
        period = self.ttl_ms / 1000 / HEARTBEATS_PER_LEASE
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                beat = self.kvstore.heartbeat(self.instance_id, self._load())
                if not await asyncio.wait_for(beat, period):
                    log.warning("lease_lapsed_reregistering")
                    self._resync_pending = True
                if self._resync_pending:
                    await self._resync()
            except (PddError, TimeoutError) as exc:
                log.warning("heartbeat_failed", error=str(exc) or "timed out")
            except Exception:  # noqa: BLE001 — a failed snapshot must not end the heartbeats
                log.exception("cache_resync_failed")

    async def _resync(self) -> None:
        """Re-register with an empty index and republish the whole cache ahead of newer events."""
        await self._register(reset_index=True)
        # NOTE: hold live events from here: whatever the engine emits after the snapshot
        # was read must reach kvstore after the snapshot, never before it.
        self._held = []
        try:
            events = await self._snapshot()
            for ev in events:
                self._events.put_nowait(ev)
            self._resync_pending = False
            self.resyncs += 1
            log.info("cache_republished", events=len(events))
        finally:
            held, self._held = self._held, None
            for ev in held:
                self._events.put_nowait(ev)

    async def _publisher(self) -> None:
        while True:
            batch = [await self._events.get()]
            while not self._events.empty() and len(batch) < MAX_EVENTS_PER_CALL:
                batch.append(self._events.get_nowait())
            await self._send(batch)
            for _ in batch:
                self._events.task_done()

    async def _send(self, batch: list[CacheEvent]) -> None:
        """Publish one batch, retrying a few times."""
        for attempt in range(5):
            try:
                async with self._wire:
                    publish = self.kvstore.publish(
                        self.instance_id, batch, first_seq=self._next_seq
                    )
                    ack = await asyncio.wait_for(publish, 5.0)
                    self._next_seq += len(batch)
                if isinstance(ack, PublishResult) and ack.resync:
                    # NOTE: kvstore saw a gap before this batch and applied none of it; the
                    # snapshot taken by the resync holds whatever these events did.
                    log.warning("cache_event_gap_resync", first_seq=self._next_seq - len(batch))
                    self.gaps += 1
                    self._resync_pending = True
                    self._wake.set()
                    return
                self.published += len(batch)
                return
            except (PddError, TimeoutError) as exc:
                log.warning("publish_failed", attempt=attempt, error=str(exc) or "timed out")
                await asyncio.sleep(0.2 * (attempt + 1))
        # NOTE: a gap in the event sequence kvstore saw: its index may now claim blocks this
        # instance evicted (or miss ones it stored). The next heartbeat that gets through
        # re-registers with a reset index and republishes the whole cache (``_resync``).
        log.warning("cache_events_dropped_resync_pending", events=len(batch))
        async with self._wire:
            self._next_seq += len(batch)  # so kvstore, too, sees the gap
        self._resync_pending = True
