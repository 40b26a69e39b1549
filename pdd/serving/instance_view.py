"""The gateway's last known instances (with their load), to route by when the index is down.

kvstore's answers keep it current: every successful PredictHits (it names every live instance
with its last reported load), every ``list()``, and — once ``start_refreshing`` was called (the
gateway service does, when it serves) — a background ``list()`` every ``refresh_s``, so an idle
gateway's view is fresh when an outage begins. When kvstore (or the Redis behind it) is unreachable — a call fails UNAVAILABLE or
DEADLINE_EXCEEDED — ``predict`` answers the documented fallback instead of failing the request:

  every last known instance, with predicted cached_tokens 0 (no hit is known),

so the router's load scores alone pick the instances, and every request looks like a miss: with
a relay registered, low-hit or not, it runs P-RLD-MD through the relay. The MainDecode picked
still matches what it holds when it accepts (prefill pushes only the rest), but the one holding
a prompt's prefix is picked only by chance. The same fallback covers an index that answers but
lacks a role the view confirmed less than ``hold_s`` ago: a restarted Redis comes back empty and
the instances re-register one heartbeat at a time, so for a moment it may know MainDecode but no
prefill. The instances it does name keep their predicted hits; the last known ones of the missing
roles are added with none (``pdd chaos`` found requests failing ``no live prefill instance``
in that window).
With no instance ever seen, the index's own error is raised, as without the view.

The first fallback of an outage logs ``routing_without_index``; the first answer after it logs
``index_restored`` with how many requests were routed without it; each is counted in
``pdd_index_fallback_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import structlog

from pdd.core.errors import PddError, PeerError
from pdd.core.instance import Instance, Role
from pdd.prefix_index.store import Hit
from pdd.telemetry.metrics import INDEX_FALLBACK

log = structlog.get_logger(__name__)

# Peer statuses that mean "the index is not there", not "the request is wrong".
INDEX_DOWN_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


class Index(Protocol):
    """What the view asks of kvstore (``pdd.wire.kvstore_client.KvstoreClient``; tests: fakes)."""

    async def list(self, role: Role | None = None) -> list[Instance]: ...
    async def predict(
        self, prompt: Sequence[int], salt: str = "", *, block_sizes: Collection[int] = ()
    ) -> list[Hit]: ...


class InstanceView:
    def __init__(
        self,
        kvstore: Callable[[], Index],
        *,
        refresh_s: float = 3.0,
        hold_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``kvstore``: a client per call (the gateway's ``peers.kvstore``). ``hold_s``: how long
        after its last confirmation the view outlives an index that answers "no instance"."""
        if refresh_s <= 0:
            raise ValueError(f"refresh_s: must be positive, got {refresh_s}")
        if hold_s < 0:
            raise ValueError(f"hold_s: must be >= 0, got {hold_s}")
        self._kvstore = kvstore
        self.refresh_s = refresh_s
        self.hold_s = hold_s
        self._clock = clock
        self._instances: list[Instance] = []
        self._confirmed_at = 0.0  # clock() of the last answer naming at least one instance
        self._refresher: asyncio.Task | None = None
        self._closed = False
        # Requests routed without the index in the current outage (0: the index answers).
        self.outage_fallbacks = 0

    @property
    def known(self) -> list[Instance]:
        return list(self._instances)

    async def predict(self, prompt: Sequence[int], salt: str = "") -> list[Hit]:
        """kvstore's predicted hits, else the fallback (module docstring). The prompt goes
        hashed at the block sizes of the instances known (kvstore then hashes none of it)."""
        block_sizes = {i.block_size for i in self._instances}
        try:
            hits = await self._kvstore().predict(prompt, salt, block_sizes=block_sizes)
        except PeerError as exc:
            if exc.code not in INDEX_DOWN_CODES or not self._instances:
                raise
            return self._fallback(f"{exc.code}: {exc}")
        if missing := self._missing([h.instance for h in hits]):
            roles = sorted({i.ref.role.value for i in missing})
            return hits + self._fallback(f"the index lacks {roles} (Redis restarted?)", missing)
        self._answered([h.instance for h in hits])
        return hits

    async def list(self) -> list[Instance]:
        """kvstore's live instances, else (index down, or emptied within ``hold_s``) the last
        known ones: the gateway can still route, so it is still ready."""
        try:
            instances = await self._kvstore().list()
        except PeerError as exc:
            if exc.code not in INDEX_DOWN_CODES or not self._instances:
                raise
            return self.known
        if missing := self._missing(instances):
            return instances + missing
        self._answered(instances)
        return instances

    async def close(self) -> None:
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    def _holding(self) -> bool:
        return bool(self._instances) and self._clock() - self._confirmed_at < self.hold_s

    def _missing(self, answer: list[Instance]) -> list[Instance]:
        """The last known instances of every role ``answer`` lacks, while the view is fresh."""
        if not self._holding():
            return []
        roles = {i.ref.role for i in answer}
        return [i for i in self._instances if i.ref.role not in roles]

    def _answered(self, instances: list[Instance]) -> None:
        self._instances = list(instances)
        if instances:
            self._confirmed_at = self._clock()
        if self.outage_fallbacks:
            log.info("index_restored", routed_without_index=self.outage_fallbacks)
            self.outage_fallbacks = 0

    def _fallback(self, reason: str, instances: list[Instance] | None = None) -> list[Hit]:
        """``instances`` (default: every last known one) with no predicted hit, counted."""
        INDEX_FALLBACK.inc()
        if not self.outage_fallbacks:
            # NOTE: once per outage; ``index_restored`` says how many requests it covered.
            log.warning(
                "routing_without_index",
                reason=reason,
                instances=len(self._instances),
                confirmed_s_ago=round(self._clock() - self._confirmed_at, 1),
            )
        self.outage_fallbacks += 1
        return [Hit(i, 0, 0.0) for i in (self._instances if instances is None else instances)]

    def start_refreshing(self) -> None:
        """Refresh the view in the background until ``close`` (call inside the serving loop)."""
        if self._refresher is None and not self._closed:
            self._refresher = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                instances = await self._kvstore().list()
            except PddError:
                continue  # the index is down: keep the last known list; routing logs the outage
            if not self._missing(instances):
                self._answered(instances)
