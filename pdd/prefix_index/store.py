"""The kvstore's domain: instance registry + prefix index over one Redis.

Life of a prediction: the gateway sends a prompt's token ids (and cache
salt) → the live instances are read from the registry (filtered by id/role)
→ each instance's chained block hashes are tested against its block set →
per instance, the leading tokens it holds and the hit rate (a binary search over the chain in
Redis, O(log blocks) lookups per instance: ``index``).

Every call fails fast with ``UnavailableError`` when Redis is unreachable (``redis_outage``); the
client's socket timeouts (kvstore's ``redis_timeout_s``) bound how long "fast" is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from pdd.core.cache_event import CacheEvent, PublishResult
from pdd.core.errors import InvalidArgumentError, NotFoundError
from pdd.core.instance import Instance, InstanceLoad, Role
from pdd.prefix_index.index import PrefixIndex
from pdd.prefix_index.redis_outage import redis_address, redis_outage
from pdd.prefix_index.registry import InstanceRegistry


@dataclass(frozen=True)
class Hit:
    instance: Instance
    cached_tokens: int
    hit_rate: float


class PrefixStore:
    def __init__(self, redis: Redis | RedisCluster, prefix: str = "pdd") -> None:
        self.redis = redis
        self.registry = InstanceRegistry(redis, prefix)
        self.index = PrefixIndex(redis, self.registry)
        self._where = redis_address(redis)

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        with redis_outage(self._where):
            await self.registry.register(inst, ttl_ms, reset_index=reset_index)

    async def heartbeat(self, instance_id: str, load: InstanceLoad) -> bool:
        with redis_outage(self._where):
            return await self.registry.heartbeat(instance_id, load)

    async def deregister(self, instance_id: str) -> bool:
        with redis_outage(self._where):
            return await self.registry.deregister(instance_id)

    async def list(self, role: Role | None = None) -> list[Instance]:
        with redis_outage(self._where):
            return await self.registry.list(role)

    async def publish(
        self, instance_id: str, events: Iterable[CacheEvent], *, first_seq: int = 0
    ) -> PublishResult:
        """Apply the events; ``first_seq``: the sequence number of the first (0: unsequenced).

        ``resync`` in the answer: a gap before this batch; the instance must republish its cache.
        """
        with redis_outage(self._where):
            if await self.registry.get(instance_id) is None:
                raise NotFoundError(
                    f"instance_id: {instance_id!r} is not registered (lease expired?)"
                )
            return await self.index.apply(instance_id, events, first_seq=first_seq)

    @property
    def gaps(self) -> int:
        """Batches refused for a gap in their instance's event sequence (each asked a resync)."""
        return self.index.gaps

    async def predict(
        self,
        prompt: Sequence[int],
        salt: str = "",
        *,
        instance_ids: Sequence[str] = (),
        role: Role | None = None,
        reference: bool = False,
    ) -> list[Hit]:
        """``reference``: count with the slow per-block reference (tests, ``pdd bench index``)."""
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        with redis_outage(self._where):
            live = await self.registry.list(role)
            if instance_ids:
                wanted = set(instance_ids)
                live = [i for i in live if i.ref.instance_id in wanted]
            count = self.index.cached_tokens_reference if reference else self.index.cached_tokens
            cached = await count(prompt, salt, live)
        n = len(prompt)
        return [Hit(i, cached[i.ref.instance_id], cached[i.ref.instance_id] / n) for i in live]
