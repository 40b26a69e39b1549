"""Which KV blocks each instance caches, and how much of a prompt it holds.

Fed by the instances' cache events (blocks stored / evicted / cleared, named
by chained block hashes from ``pdd.core.block_hash``); answers, per instance, the
number of leading prompt tokens it holds. A chained hash names a whole
prefix, so the answer is the count of leading block hashes present.

Keys: ``p:blocks:<id>`` — a Redis set of 8-byte block hashes per instance
(its expiry follows the instance's lease, see ``registry``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis.asyncio import Redis

from pdd.core.block_hash import chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance
from pdd.prefix_index.registry import InstanceRegistry


def _member(h: int) -> bytes:
    return h.to_bytes(8, "little")


class PrefixIndex:
    def __init__(self, redis: Redis, registry: InstanceRegistry) -> None:
        self._redis = redis
        self._registry = registry

    async def apply(self, instance_id: str, events: Iterable[CacheEvent]) -> int:
        """Apply events in order; returns how many were applied."""
        key = self._registry.blocks_key(instance_id)
        applied = 0
        async with self._redis.pipeline(transaction=True) as pipe:
            for ev in events:
                if ev.kind == "stored" and ev.block_hashes:
                    pipe.sadd(key, *map(_member, ev.block_hashes))
                elif ev.kind in ("evicted", "cleared") and ev.block_hashes:
                    pipe.srem(key, *map(_member, ev.block_hashes))
                elif ev.kind == "cleared":
                    # NOTE: a cleared event without hashes means "everything this instance had".
                    pipe.delete(key)
                elif ev.kind not in ("stored", "evicted"):
                    raise ValueError(f"events.kind: unknown cache event kind {ev.kind!r}")
                applied += 1
            await pipe.execute()
        return applied

    async def cached_tokens(
        self, prompt: Sequence[int], salt: str, instances: Sequence[Instance]
    ) -> dict[str, int]:
        """Leading tokens of ``prompt`` each instance holds (a multiple of its block size)."""
        hashes_by_bs: dict[int, list[int]] = {}
        for inst in instances:
            if inst.block_size not in hashes_by_bs:
                hashes_by_bs[inst.block_size] = chain_hashes(prompt, inst.block_size, salt)
        async with self._redis.pipeline(transaction=False) as pipe:
            for inst in instances:
                hashes = hashes_by_bs[inst.block_size]
                if hashes:
                    pipe.smismember(
                        self._registry.blocks_key(inst.ref.instance_id),
                        [_member(h) for h in hashes],
                    )
            replies = iter(await pipe.execute())
        result: dict[str, int] = {}
        for inst in instances:
            present = next(replies) if hashes_by_bs[inst.block_size] else []
            leading = 0
            for hit in present:
                if not hit:
                    break
                leading += 1
            result[inst.ref.instance_id] = leading * inst.block_size
        return result

    async def block_count(self, instance_id: str) -> int:
        return int(await self._redis.scard(self._registry.blocks_key(instance_id)))
