"""Live serving instances, kept in Redis with a TTL lease each.

An instance registers with a lease (``ttl_ms``) and renews it by heartbeat;
when the lease lapses Redis drops the record, and ``list`` stops returning
it (its block set carries the same expiry, so its index entries go too).

Keys (under a configurable prefix ``p``):
  ``p:inst:{<id>}``        JSON record of the instance, PEXPIRE = lease
  ``p:inst:{<id>}:lease``  its lease length
  ``p:instances``          set of ids ever registered (pruned lazily on ``list``)
and the index's (``index``): ``p:blocks:{<id>}``, ``p:parents:{<id>}``, ``p:kids:{<id>}``,
``p:seq:{<id>}``.

NOTE (Redis Cluster): ``{<id>}`` is a hash tag, so every key of one instance lives in one slot and
each multi-key command or transaction below touches one instance's keys only; ``p:instances`` is
written on its own. ``list`` reads the records with one MGET (per slot on a cluster).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.link_state import LinkState


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
            "load": dataclasses.asdict(inst.load),  # NOTE: links as a list of dicts
            "last_heartbeat_ms": inst.last_heartbeat_ms,
        }
    )


def _decode(raw: bytes | str) -> Instance:
    d = json.loads(raw)
    ref = InstanceRef(d["instance_id"], d["address"], Role(d["role"]), d["cluster"])
    load = dict(d["load"])
    # NOTE: a record written before links were reported has none.
    load["links"] = tuple(LinkState(**lk) for lk in load.get("links", ()))
    return Instance(ref, d["block_size"], d["model"], InstanceLoad(**load), d["last_heartbeat_ms"])


# NOTE: a record changes only at a heartbeat, and every prediction reads all of them: decoded
# once per version (Instance is frozen, so sharing one is safe); ~1 ms saved per 64 instances.
decode_record = functools.lru_cache(maxsize=4096)(_decode)


class InstanceRegistry:
    def __init__(self, redis: Redis | RedisCluster, prefix: str = "pdd") -> None:
        self._redis = redis
        self._prefix = prefix
        self._cluster = isinstance(redis, RedisCluster)

    def _key(self, instance_id: str) -> str:
        return self.instance_key(instance_id)

    def instance_key(self, instance_id: str) -> str:
        return f"{self._prefix}:inst:{{{instance_id}}}"

    def blocks_key(self, instance_id: str) -> str:
        return f"{self._prefix}:blocks:{{{instance_id}}}"

    def parents_key(self, instance_id: str) -> str:
        return f"{self._prefix}:parents:{{{instance_id}}}"

    def kids_key(self, instance_id: str) -> str:
        return f"{self._prefix}:kids:{{{instance_id}}}"

    def seq_key(self, instance_id: str) -> str:
        return f"{self._prefix}:seq:{{{instance_id}}}"

    def index_keys(self, instance_id: str) -> list[str]:
        """Every index key of the instance (one slot), the block set first."""
        return [
            self.blocks_key(instance_id),
            self.parents_key(instance_id),
            self.kids_key(instance_id),
            self.seq_key(instance_id),
        ]

    @property
    def ids_key(self) -> str:
        """The set of registered ids (its own slot on a cluster; pruned lazily by ``list``)."""
        return f"{self._prefix}:instances"

    async def register(self, inst: Instance, ttl_ms: int, *, reset_index: bool = False) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms: must be positive, got {ttl_ms}")
        inst = Instance(inst.ref, inst.block_size, inst.model, inst.load, _now_ms())
        iid = inst.ref.instance_id
        key = self._key(iid)
        # NOTE: the record first, then the id into the (other-slot) id set: ``list`` prunes an
        # id it finds without a record, so the other order let a ``list`` racing a registration
        # unlist the instance for good. Unlisted between the two (or after a crash there), it is
        # listed again by its next heartbeat.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(key, _encode(inst), px=ttl_ms)
            pipe.hset(f"{key}:lease", mapping={"ttl_ms": ttl_ms})
            pipe.pexpire(f"{key}:lease", ttl_ms)
            if reset_index:
                # A fresh index expects the instance's cache events from sequence number 1.
                pipe.delete(*self.index_keys(iid))
                pipe.set(self.seq_key(iid), 1, px=ttl_ms)
            else:
                for k in self.index_keys(iid):
                    pipe.pexpire(k, ttl_ms)
            await pipe.execute()
        await self._redis.sadd(self.ids_key, iid)

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
            # NOTE: XX: a deregistration (or lapse) since the GET above is not undone; the
            # instance stays gone and learns so (False), as predictions already do.
            pipe.set(key, _encode(inst), px=ttl_ms, xx=True)
            pipe.pexpire(f"{key}:lease", ttl_ms)
            for k in self.index_keys(instance_id):
                pipe.pexpire(k, ttl_ms)
            renewed = (await pipe.execute())[0]
        if not renewed:
            return False
        # NOTE: listed again at each heartbeat (see ``register``).
        await self._redis.sadd(self.ids_key, instance_id)
        return True

    async def deregister(self, instance_id: str) -> bool:
        key = self._key(instance_id)
        removed = await self._redis.delete(key, f"{key}:lease", *self.index_keys(instance_id))
        await self._redis.srem(self.ids_key, instance_id)
        return bool(removed)

    async def get(self, instance_id: str) -> Instance | None:
        raw = await self._redis.get(self._key(instance_id))
        return None if raw is None else _decode(raw)

    async def list(self, role: Role | None = None) -> list[Instance]:
        ids = sorted(
            i.decode() if isinstance(i, bytes) else i
            for i in await self._redis.smembers(self.ids_key)
        )
        if not ids:
            return []
        keys = [self._key(i) for i in ids]
        raws = await (self._redis.mget_nonatomic(keys) if self._cluster else self._redis.mget(keys))
        gone = [i for i, raw in zip(ids, raws) if raw is None]
        if gone:
            await self._redis.srem(self.ids_key, *gone)
        live = [decode_record(raw) for raw in raws if raw is not None]
        return [i for i in live if role is None or i.ref.role is role]
