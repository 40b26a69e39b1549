"""An instance's membership in the stack: lease, load reports, cache events.

Life: ``start()`` registers the instance with kvstore (resetting its old
index entries — a restarted instance holds no KV) → a background task
heartbeats every ttl/3 with the current load, re-registering and
republishing its whole cache if the lease had lapsed → cache events from the
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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import structlog

from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceLoad
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.tls import TlsConfig, open_channel
from pdd.wire import kvstore as conv
from pdd.wire.common import instance_ref_to_pb

log = structlog.get_logger(__name__)

MAX_EVENTS_PER_CALL = 256

# The cache's whole content as "stored" events (see ``RadixCache.snapshot_events``).
Snapshot = Callable[[], Awaitable[list[CacheEvent]]]


async def _no_cache() -> list[CacheEvent]:
    return []


class Membership:
    def __init__(
        self,
        kvstore_address: str,
        instance: Instance,
        *,
        ttl_ms: int = 6000,
        load: Callable[[], InstanceLoad] = InstanceLoad,
        snapshot: Snapshot = _no_cache,
        tls: TlsConfig | None = None,
    ) -> None:
        self.instance = instance
        self.ttl_ms = ttl_ms
        self._load = load
        self._snapshot = snapshot
        self._channel = open_channel(kvstore_address, tls)
        self._stub = pb_grpc.KvstoreServiceStub(self._channel)
        self._events: asyncio.Queue[CacheEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        # Live events published while a snapshot is being taken; queued after it (see module NOTE).
        self._held: list[CacheEvent] | None = None
        # Set when the lease lapsed and the index is not rebuilt yet (a failed snapshot retries).
        self._resync_pending = False
        self.published = 0
        self.resyncs = 0

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
            await self._stub.DeregisterInstance(
                pb.DeregisterInstanceRequest(instance_id=self.instance.ref.instance_id), timeout=2.0
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("deregister_failed", error=exc.details())
        await self._channel.close()

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
        inst = self.instance
        await self._stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                ref=instance_ref_to_pb(inst.ref),
                block_size=inst.block_size,
                model=inst.model,
                ttl_ms=self.ttl_ms,
                reset_index=reset_index,
            ),
            timeout=5.0,
        )

    async def _heartbeat(self) -> None:
        period = self.ttl_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                resp = await self._stub.Heartbeat(
                    pb.HeartbeatRequest(
                        instance_id=self.instance.ref.instance_id,
                        load=conv.load_to_pb(self._load()),
                    ),
                    timeout=period,
                )
                if not resp.known:
                    log.warning("lease_lapsed_reregistering")
                    self._resync_pending = True
                if self._resync_pending:
                    await self._resync()
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat_failed", error=exc.details())
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
            request = pb.PublishCacheEventsRequest(
                instance_id=self.instance.ref.instance_id,
                events=[conv.cache_event_to_pb(e) for e in batch],
            )
            for attempt in range(5):
                try:
                    await self._stub.PublishCacheEvents(request, timeout=5.0)
                    self.published += len(batch)
                    break
                except grpc.aio.AioRpcError as exc:
                    log.warning("publish_failed", attempt=attempt, error=exc.details())
                    await asyncio.sleep(0.2 * (attempt + 1))
            for _ in batch:
                self._events.task_done()
