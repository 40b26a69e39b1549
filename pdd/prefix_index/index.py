"""Which KV blocks each instance caches, and how much of a prompt it holds.

Fed by the instances' cache events (blocks stored / evicted / cleared, named
by chained block hashes from ``pdd.core.block_hash``); answers, per instance, the
number of leading prompt tokens it holds. A chained hash names a whole
prefix, so the answer is the count of leading block hashes present.

Keys (each instance's under one Redis Cluster hash tag, ``{<id>}``, so one slot; see ``registry``):
  ``p:blocks:{<id>}``   set of 8-byte block hashes the instance holds
  ``p:parents:{<id>}``  hash: block → its parent block (8 bytes each)
  ``p:kids:{<id>}``     hash: block → its children, concatenated (not kept for the root)
  ``p:seq:{<id>}``      the sequence number of the next cache event expected from it

NOTE (the invariant that makes predictions O(log blocks)): each instance's block set is
*prefix-closed* — a block is in it only while its parent is (or it is a first block). A
"stored" block whose parent is absent is not added (an orphan: its prefix was evicted or an event
was lost), and evicting a block removes everything below it (``p:kids``). So along one prompt's
chain, presence is monotone (held block i ⇒ held blocks < i) and the leading hit is found by a
search over the chain (4-ary: 3 probes a round, ``SEARCH_LUA``) — in one Lua call that probes
every instance (``_PREDICT`` here; kvstore's, which reads the registry in the same call, is
``live_predict``), O(log blocks) lookups each. A middle block evicted by force therefore never
lets the index over-count: the blocks after it go with it (an engine's radix cache cannot match
past a missing block either). ``cached_tokens_reference`` is the obviously-correct per-block count, kept for tests.

Events carry per-instance sequence numbers (``first_seq`` of a batch; 0 = unsequenced): a batch
past the next expected one is a gap — nothing of it is applied, and the instance is asked for
a snapshot (``PublishResult.resync``); a batch already seen (a retry) is not applied twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from pdd.core.block_hash import ROOT_HASH, PromptChains, chain_hashes_reference, prompt_chain
from pdd.core.cache_event import CacheEvent, PublishResult
from pdd.core.instance import Instance
from pdd.prefix_index.registry import InstanceRegistry

_ROOT = ROOT_HASH.to_bytes(8, "little")
_KIND_CODE = {"stored": b"s", "evicted": b"e", "cleared": b"c"}

# KEYS: blocks, parents, kids, seq. ARGV: first_seq, then (kind, parent, hashes…) per event.
# Returns {applied, resync (0/1)}. See the module NOTE for the invariant it keeps.
_APPLY = """
local blocks, parents, kids, seqk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local first = tonumber(ARGV[1])
local n = (#ARGV - 1) / 3
local skip = 0
if first > 0 then
  local expected = tonumber(redis.call('GET', seqk) or '1')
  if first > expected then return {0, 1} end
  if first + n <= expected then return {0, 0} end
  skip = expected - first
  redis.call('SET', seqk, first + n, 'KEEPTTL')
end
local root = string.rep('\\0', 8)
local function unlink(h)
  local p = redis.call('HGET', parents, h)
  redis.call('HDEL', parents, h)
  if p and p ~= root then
    local ks = redis.call('HGET', kids, p)
    if ks then
      local rest = {}
      for i = 1, #ks, 8 do
        local c = string.sub(ks, i, i + 7)
        if c ~= h then rest[#rest + 1] = c end
      end
      if #rest == 0 then redis.call('HDEL', kids, p)
      else redis.call('HSET', kids, p, table.concat(rest)) end
    end
  end
end
local function evict(h)
  if redis.call('SREM', blocks, h) == 0 then return end
  unlink(h)
  local stack = {h}
  while #stack > 0 do
    local x = table.remove(stack)
    local ks = redis.call('HGET', kids, x)
    redis.call('HDEL', kids, x)
    if ks then
      for i = 1, #ks, 8 do
        local c = string.sub(ks, i, i + 7)
        if redis.call('SREM', blocks, c) == 1 then
          redis.call('HDEL', parents, c)
          stack[#stack + 1] = c
        end
      end
    end
  end
end
local applied = 0
for e = skip, n - 1 do
  local kind, parent, hs = ARGV[2 + 3 * e], ARGV[3 + 3 * e], ARGV[4 + 3 * e]
  if kind == 's' then
    local p = parent
    for i = 1, #hs, 8 do
      local h = string.sub(hs, i, i + 7)
      if p ~= root and redis.call('SISMEMBER', blocks, p) == 0 then break end
      if redis.call('SADD', blocks, h) == 1 then
        redis.call('HSET', parents, h, p)
        if p ~= root then
          redis.call('HSET', kids, p, (redis.call('HGET', kids, p) or '') .. h)
        end
      end
      p = h
    end
  elseif kind == 'n' then
  elseif #hs == 0 then
    redis.call('DEL', blocks, parents, kids)
  else
    for i = #hs - 7, 1, -8 do evict(string.sub(hs, i, i + 7)) end
  end
  applied = applied + 1
end
return {applied, 0}
"""

# The search, shared by every predict script: ``leading(key, chain, g)`` is the count of leading
# blocks of ``chain`` (concatenated 8-byte hashes) held in the set ``key``; ``g`` (0: none) a
# guess of it, from an earlier answer (``live_predict``), that only picks where to probe first.
# NOTE: a 4-ary search (3 probes in one SMISMEMBER per round: 4,096 blocks take 6 rounds). Each
# redis.call from Lua costs ~1.5 us plus ~0.5 us per argument, so 3 probes a round is the cheapest
# (measured at 64 instances, 4,096 blocks: ~0.6 ms in Redis for all of them; 32 probes a round
# cost ~2.5x that, 15 ~2.3x, 7 ~1.2x). The first call probes the first and the last block, and
# around the guess (blocks g and g + 1): an instance holding none of the prompt, all of it, or
# exactly g blocks of it is answered by that call alone (~0.2 ms for 64 instances when every
# guess is right). ``lo``: blocks known held; ``hi``: at most held. Probes are taken in order and
# the first miss bounds ``hi``: the set being prefix-closed (module NOTE), presence is monotone
# along the chain, so any probe positions find the same leading run — a wrong guess costs
# rounds, never a wrong count.
SEARCH_LUA = """
local function leading(key, chain, g)
  local n = #chain / 8
  if n == 0 then return 0 end
  local lo, hi = 0, n
  local pos = {1}
  if g > 1 and g < n then pos[2] = g end
  if g > 0 and g + 1 < n then pos[#pos + 1] = g + 1 end
  if n > 1 then pos[#pos + 1] = n end
  while lo < hi do
    local probe = {}
    for j = 1, #pos do probe[j] = string.sub(chain, pos[j] * 8 - 7, pos[j] * 8) end
    local got = redis.call('SMISMEMBER', key, unpack(probe))
    local next_lo, next_hi = lo, hi
    for j = 1, #pos do
      if got[j] == 1 then
        next_lo = pos[j]
      else
        next_hi = pos[j] - 1
        break
      end
    end
    lo, hi = next_lo, next_hi
    local span = hi - lo
    local m = math.min(3, span)
    pos = {}
    for j = 1, m do pos[j] = lo + math.floor(j * span / m) end
  end
  return lo
end
"""

# KEYS: each instance's block set. ARGV: C, chain_1..chain_C, then per key the (1-based) chain
# it is probed with. Returns the leading blocks held, per key.
_PREDICT = (
    SEARCH_LUA
    + """
local c = tonumber(ARGV[1])
local out = {}
for k = 1, #KEYS do
  out[k] = leading(KEYS[k], ARGV[1 + tonumber(ARGV[1 + c + k])], 0)
end
return out
"""
)


def _member(h: int) -> bytes:
    return h.to_bytes(8, "little")


class PrefixIndex:
    def __init__(self, redis: Redis | RedisCluster, registry: InstanceRegistry) -> None:
        self._redis = redis
        self._registry = registry
        self._cluster = isinstance(redis, RedisCluster)
        # EVALSHA (loaded on first use, reloaded after a Redis restart: redis-py's Script).
        self._apply = redis.register_script(_APPLY)
        self._predict = redis.register_script(_PREDICT)
        # Batches refused for a gap in their instance's sequence (each asked for a resync).
        self.gaps = 0

    async def apply(
        self, instance_id: str, events: Iterable[CacheEvent], *, first_seq: int = 0
    ) -> PublishResult:
        """Apply events in order, atomically; ``first_seq``: the first one's sequence number."""
        if first_seq < 0:
            raise ValueError(f"first_seq: must be >= 0, got {first_seq}")
        args: list[bytes | int] = [first_seq]
        for ev in events:
            if ev.kind not in _KIND_CODE:
                raise ValueError(f"events.kind: unknown cache event kind {ev.kind!r}")
            # NOTE: a stored/evicted event without hashes does nothing but still holds its place
            # in the sequence (and counts as applied, as it always did).
            empty = ev.kind != "cleared" and not ev.block_hashes
            args += [
                b"n" if empty else _KIND_CODE[ev.kind],
                _member(ev.parent_hash),
                b"".join(map(_member, ev.block_hashes)),
            ]
        applied, resync = await self._apply(keys=self._registry.index_keys(instance_id), args=args)
        if resync:
            self.gaps += 1
        return PublishResult(int(applied), bool(resync))

    async def cached_tokens(
        self, prompt: Sequence[int] | PromptChains, salt: str, instances: Sequence[Instance]
    ) -> dict[str, int]:
        """Leading tokens of ``prompt`` each instance holds (a multiple of its block size).

        O(log blocks) set lookups per instance, run inside Redis: one call for every instance
        (a Redis Cluster: one per instance, concurrently, each in its instance's slot). kvstore
        predicts with ``live_predict`` (the registry read in the same call); this serves its
        fallback and the tests.
        """
        if not instances:
            return {}
        chains: dict[int, bytes] = {}
        for inst in instances:
            if inst.block_size not in chains:
                chains[inst.block_size] = prompt_chain(prompt, inst.block_size, salt)
        order = list(chains)
        chain_args = [chains[bs] for bs in order]
        if self._cluster:
            replies = await asyncio.gather(
                *(
                    self._predict(
                        keys=[self._registry.blocks_key(inst.ref.instance_id)],
                        args=[1, chains[inst.block_size], 1],
                    )
                    for inst in instances
                )
            )
            counts = [int(r[0]) for r in replies]
        else:
            keys = [self._registry.blocks_key(i.ref.instance_id) for i in instances]
            which = [order.index(i.block_size) + 1 for i in instances]
            counts = [
                int(c)
                for c in await self._predict(keys=keys, args=[len(order), *chain_args, *which])
            ]
        return {inst.ref.instance_id: n * inst.block_size for inst, n in zip(instances, counts)}

    async def cached_tokens_reference(
        self, prompt: Sequence[int], salt: str, instances: Sequence[Instance]
    ) -> dict[str, int]:
        """The slow, obviously-correct answer (the index before the O(log blocks) search): hash block by
        block with the definition, test every block of every instance, count the leading ones.

        O(blocks × instances) lookups; the tests and ``pdd bench index`` hold the searches to it.
        """
        chains: dict[int, list[bytes]] = {}
        for inst in instances:
            if inst.block_size not in chains:
                hashes = chain_hashes_reference(prompt, inst.block_size, salt)
                chains[inst.block_size] = [_member(h) for h in hashes]
        result = {i.ref.instance_id: 0 for i in instances}
        probed = [i for i in instances if chains[i.block_size]]
        if not probed:
            return result
        async with self._redis.pipeline(transaction=False) as pipe:
            for inst in probed:
                key = self._registry.blocks_key(inst.ref.instance_id)
                pipe.smismember(key, chains[inst.block_size])
            replies = await pipe.execute()
        for inst, present in zip(probed, replies):
            leading = 0
            for hit in present:
                if not hit:
                    break
                leading += 1
            result[inst.ref.instance_id] = leading * inst.block_size
        return result

    async def block_count(self, instance_id: str) -> int:
        return int(await self._redis.scard(self._registry.blocks_key(instance_id)))
