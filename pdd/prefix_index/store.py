"""The kvstore's domain: instance registry + prefix index over one Redis.

Life of a prediction: the gateway sends a prompt's chained block hashes, per block size of the
instances it knows (or, knowing none, its token ids and cache salt, hashed here) →
one Lua call that reads the live instances (filtered by id/role) and searches each one's block
set → per instance, the leading tokens it holds and the hit rate (a 4-ary search over the chain
in Redis, O(log blocks) lookups per instance: ``index``; the registry read and the search in one
atomic call, the instances to pass it from a view kvstore keeps: ``live_predict``).

Every call fails fast with ``UnavailableError`` when Redis is unreachable (``redis_outage``); the
client's socket timeouts (kvstore's ``redis_timeout_s``) bound how long "fast" is.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from pdd.core.block_hash import PromptChains
from pdd.core.cache_event import CacheEvent, PublishResult
from pdd.core.errors import InvalidArgumentError, NotFoundError
from pdd.core.instance import Instance, InstanceLoad, Role
from pdd.prefix_index.index import PrefixIndex
from pdd.prefix_index.live_predict import LivePredictor, PredictCost
from pdd.prefix_index.redis_outage import redis_address, redis_outage
from pdd.prefix_index.registry import InstanceRegistry


@dataclass(frozen=True)
class Hit:
    instance: Instance
    cached_tokens: int
    hit_rate: float


class PrefixStore:
    def __init__(
        self, redis: Redis | RedisCluster, prefix: str = "pdd", *, guesses: bool = True
    ) -> None:
        """``guesses``: searches start from remembered runs (``live_predict.RunMemory``)."""
        self.redis = redis
        self.registry = InstanceRegistry(redis, prefix)
        self.index = PrefixIndex(redis, self.registry)
        self.predictor = LivePredictor(redis, self.registry, self.index, guesses=guesses)
        self._where = redis_address(redis)

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        with redis_outage(self._where):
            await self.registry.register(inst, ttl_ms, reset_index=reset_index)
        # NOTE: the predictor would find its view stale by itself (it checks every call); told,
        # it lists the registry at once instead of after a wasted call.
        self.predictor.forget()

    async def heartbeat(self, instance_id: str, load: InstanceLoad) -> bool:
        with redis_outage(self._where):
            return await self.registry.heartbeat(instance_id, load)

    async def deregister(self, instance_id: str) -> bool:
        with redis_outage(self._where):
            gone = await self.registry.deregister(instance_id)
        self.predictor.forget()
        return gone

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
        prompt: Sequence[int] | PromptChains,
        salt: str = "",
        *,
        instance_ids: Sequence[str] = (),
        role: Role | None = None,
        reference: bool = False,
        cost: PredictCost | None = None,
    ) -> builtins.list[Hit]:  # NOTE: ``list`` here is the method above
        """``prompt``: its token ids, or its chains as the caller hashed them (an instance of a
        block size without one: ``FailedPreconditionError``).
        ``reference``: count with the slow per-block reference, from token ids (tests, ``pdd
        bench index``). ``cost``: filled in with where the time went (``pdd bench index``)."""
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        with redis_outage(self._where):
            if reference:
                if isinstance(prompt, PromptChains):
                    raise TypeError("reference: counts from the prompt's token ids, not its chains")
                live = await self.registry.list(role)
                if instance_ids:
                    wanted = set(instance_ids)
                    live = [i for i in live if i.ref.instance_id in wanted]
                cached = await self.index.cached_tokens_reference(prompt, salt, live)
                held = [(i, cached[i.ref.instance_id]) for i in live]
            else:
                held = await self.predictor.predict(
                    prompt, salt, instance_ids=instance_ids, role=role, cost=cost
                )
        n = len(prompt)
        return [Hit(i, tokens, tokens / n) for i, tokens in held]
