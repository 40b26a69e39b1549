"""Live serving instances, kept in Redis with a TTL lease each.

An instance registers with a lease (``ttl_ms``) and renews it by heartbeat;
when the lease lapses Redis drops the record, and ``list`` stops returning
it (its block set carries the same expiry, so its index entries go too).

Keys (under a configurable prefix ``p``):
  ``p:inst:<id>``   JSON record of the instance, PEXPIRE = lease
  ``p:instances``   set of ids ever registered (pruned lazily on ``list``)
"""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role


def _now_ms() -> int:
    return int(time.time() * 1000)


def _encode(inst: Instance) -> str:
    ref = inst.ref
    return json.dumps(
        {
            "instance_id": ref.instance_id,
            "address": ref.address,
            "role": ref.role.value,
            "cluster": ref.cluster,
            "block_size": inst.block_size,
            "model": inst.model,
            "load": vars(inst.load),
            "last_heartbeat_ms": inst.last_heartbeat_ms,
        }
    )


def _decode(raw: bytes | str) -> Instance:
    d = json.loads(raw)
    ref = InstanceRef(d["instance_id"], d["address"], Role(d["role"]), d["cluster"])
    return Instance(
        ref, d["block_size"], d["model"], InstanceLoad(**d["load"]), d["last_heartbeat_ms"]
    )


class InstanceRegistry:
    def __init__(self, redis: Redis, prefix: str = "pdd") -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, instance_id: str) -> str:
        return f"{self._prefix}:inst:{instance_id}"

    def blocks_key(self, instance_id: str) -> str:
        return f"{self._prefix}:blocks:{instance_id}"

    @property
    def _ids_key(self) -> str:
        return f"{self._prefix}:instances"

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms: must be positive, got {ttl_ms}")
        inst = Instance(inst.ref, inst.block_size, inst.model, inst.load, _now_ms())
        key = self._key(inst.ref.instance_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(key, _encode(inst), px=ttl_ms)
            pipe.hset(f"{key}:lease", mapping={"ttl_ms": ttl_ms})
            pipe.pexpire(f"{key}:lease", ttl_ms)
            pipe.sadd(self._ids_key, inst.ref.instance_id)
            if reset_index:
                pipe.delete(self.blocks_key(inst.ref.instance_id))
            else:
                pipe.pexpire(self.blocks_key(inst.ref.instance_id), ttl_ms)
            await pipe.execute()

    async def heartbeat(self, instance_id: str, load: InstanceLoad) -> bool:
        """Renew the lease; False when the instance is unknown (lease lapsed)."""
        key = self._key(instance_id)
        raw, ttl = await self._redis.get(key), await self._redis.hget(f"{key}:lease", "ttl_ms")
        if raw is None or ttl is None:
            return False
        old = _decode(raw)
        inst = Instance(old.ref, old.block_size, old.model, load, _now_ms())
        ttl_ms = int(ttl)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(key, _encode(inst), px=ttl_ms)
            pipe.pexpire(f"{key}:lease", ttl_ms)
            pipe.pexpire(self.blocks_key(instance_id), ttl_ms)
            await pipe.execute()
        return True

    async def deregister(self, instance_id: str) -> bool:
        key = self._key(instance_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key, f"{key}:lease", self.blocks_key(instance_id))
            pipe.srem(self._ids_key, instance_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def get(self, instance_id: str) -> Instance | None:
        raw = await self._redis.get(self._key(instance_id))
        return None if raw is None else _decode(raw)

    async def list(self, role: Role | None = None) -> list[Instance]:
        ids = sorted(
            i.decode() if isinstance(i, bytes) else i
            for i in await self._redis.smembers(self._ids_key)
        )
        if not ids:
            return []
        raws = await self._redis.mget([self._key(i) for i in ids])
        gone = [i for i, raw in zip(ids, raws) if raw is None]
        if gone:
            await self._redis.srem(self._ids_key, *gone)
        live = [_decode(raw) for raw in raws if raw is not None]
        return [i for i in live if role is None or i.ref.role is role]
