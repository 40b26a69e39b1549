"""Predictions over the live instances in one Redis call, with a registry view kept by kvstore.

Life of a prediction (``PrefixStore.predict`` → ``LivePredictor.predict``): the view (the registered
instances as last listed) says which keys to pass and which block sizes to hash for → the prompt's
chained hashes, once per block size (as the gateway sent them, else from the tokens) → one Lua call
(``_PREDICT_LIVE``) that, in one atomic step, (1) checks the registry's id set is exactly the view's
ids, (2) reads each probed instance's record (none: not live, left out of the answer) and (3)
searches its block set (``index.SEARCH_LUA``) → per instance, its record as it is now and the
leading blocks it holds. A view found stale — an id added or removed, a record re-registered with
another role or block size — is listed again from the registry and the call made again; after
``_ATTEMPTS`` stale answers in a row (a registry churning faster than a round trip) the answer is
the plain one: list, then search the listed instances (``PrefixIndex.cached_tokens``).

NOTE (why a cached view never predicts a deregistered or lapsed instance): the view is never
trusted for who is live, nor for any field answered. It only names the keys of the call; the
call itself compares the id set whole and reads every record it answers with, atomically with the
search, and a deregistered instance has no record (``deregister`` deletes it; a lapsed lease
expires it; a heartbeat after either does not bring it back, ``InstanceRegistry.heartbeat``). So
each answer is the registry *at the instant of the call* — at least as fresh as listing it first,
which is what this replaced. Loads come back with every call (a heartbeat's new load is in the
next answer); a view is only refreshed when instances come, go, or change role or block size.
On a Redis Cluster the id set is in another slot than the records: it is read beside the
per-instance calls (concurrently), not atomically with them; each record is still read in one
step with its own instance's search, so a deregistered instance is never answered there either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from pdd.core.block_hash import PromptChains, prompt_chain
from pdd.core.instance import Instance, Role
from pdd.prefix_index.index import SEARCH_LUA, PrefixIndex
from pdd.prefix_index.registry import InstanceRegistry, decode_record

# KEYS: [the id set (when checked),] then per probed instance its record and its block set.
# ARGV: the number of ids checked (-1: no id set in KEYS), those ids, C, chain_1..chain_C, then
# one string of two integers per probed instance: the chain it is searched with (0: none, its
# record only) and a guess of its leading blocks held (0: none; ``SEARCH_LUA``).
# Returns {0} when the id set is not exactly the ids given, else {1, the records joined by "\n"
# ("" for one that is gone), the leading blocks held joined by ","}.
# NOTE: records are compact JSON (``registry._encode``), which never holds a raw newline; one
# joined reply rather than a reply per instance: redis-py parses each element in Python.
_PREDICT_LIVE = (
    SEARCH_LUA
    + """
local checked = tonumber(ARGV[1])
local first, at = 1, 2
if checked >= 0 then
  if redis.call('SCARD', KEYS[1]) ~= checked then return {0} end
  for i = 2, 1 + checked, 1000 do
    local last = math.min(1 + checked, i + 999)
    for _, hit in ipairs(redis.call('SMISMEMBER', KEYS[1], unpack(ARGV, i, last))) do
      if hit == 0 then return {0} end
    end
  end
  first, at = 2, 2 + checked
end
local c = tonumber(ARGV[at])
local wg = {}
for x in string.gmatch(ARGV[at + c + 1], '%d+') do wg[#wg + 1] = tonumber(x) end
local records, counts = {}, {}
for k = 1, (#KEYS - first + 1) / 2 do
  local rec = redis.call('GET', KEYS[first + 2 * k - 2])
  local count = 0
  if rec then
    local w = wg[2 * k - 1]
    if w > 0 then count = leading(KEYS[first + 2 * k - 1], ARGV[at + w], wg[2 * k]) end
  else
    rec = ''
  end
  records[k] = rec
  counts[k] = count
end
return {1, table.concat(records, '\\n'), table.concat(counts, ',')}
"""
)

_ATTEMPTS = 3


def _bytes(reply: bytes | str) -> bytes:
    """A bulk reply as bytes, whether or not the client decodes replies."""
    return reply.encode() if isinstance(reply, str) else reply


class RunMemory:
    """Per instance, the last few leading runs it was answered to hold: (the 8-byte hash of the
    run's last block, its length in blocks).

    A prompt whose chain has that hash at that depth shares the whole run (the hash is chained),
    so the instance most likely holds exactly that much of it again — or, the prompt extending
    the run, the run and more: the guess ``SEARCH_LUA`` probes first. It picks only where to
    probe; a wrong guess (blocks since evicted or added) costs a search round or two, never a
    wrong count. It helps prompts that repeat or share a prefix with one of the last few
    predicted (a system prompt, the turn before); others are searched as without it.
    """

    def __init__(self, per_instance: int = 8) -> None:
        self._per = per_instance
        self._runs: dict[str, list[tuple[bytes, int]]] = {}

    def guess(self, instance_id: str, chain: bytes) -> int:
        """The longest remembered run of the instance that ``chain`` starts with (0: none)."""
        best = 0
        for h, blocks in self._runs.get(instance_id, ()):
            if best < blocks <= len(chain) // 8 and chain.startswith(h, 8 * (blocks - 1)):
                best = blocks
        return best

    def remember(self, instance_id: str, chain: bytes, blocks: int) -> None:
        if blocks == 0:
            return  # the first probe answers "none" by itself
        run = (chain[8 * (blocks - 1) : 8 * blocks], blocks)
        runs = self._runs.setdefault(instance_id, [])
        if runs and runs[0] == run:
            return
        if run in runs:
            runs.remove(run)
        runs.insert(0, run)
        del runs[self._per :]

    def keep_only(self, instance_ids: set[str]) -> None:
        for iid in self._runs.keys() - instance_ids:
            del self._runs[iid]


@dataclass
class PredictCost:
    """Where one prediction's time went, in seconds (filled in when passed to ``predict``)."""

    hashing: float = 0.0  # the prompt's chained hashes
    registry: float = 0.0  # listing the registry again (0 while the view holds)
    index: float = 0.0  # the Lua call(s): id set, records and search, one round trip each
    refreshes: int = 0  # views found stale and listed again
    guessed: int = 0  # instances searched from a remembered run (``RunMemory``)


class LivePredictor:
    def __init__(
        self,
        redis: Redis | RedisCluster,
        registry: InstanceRegistry,
        index: PrefixIndex,
        *,
        guesses: bool = True,
    ) -> None:
        """``guesses``: start each search from a remembered run (``RunMemory``); off, only the
        first and last blocks are probed first (``pdd bench index --no-guesses``)."""
        self._redis = redis
        self._registry = registry
        self._index = index
        self._cluster = isinstance(redis, RedisCluster)
        self._script = redis.register_script(_PREDICT_LIVE)
        self._view: list[Instance] | None = None  # sorted by id, as ``list`` answers
        self._runs = RunMemory() if guesses else None

    def forget(self) -> None:
        """Drop the view (this process changed the registry): the next call lists it again."""
        self._view = None

    async def predict(
        self,
        prompt: Sequence[int] | PromptChains,
        salt: str,
        *,
        instance_ids: Sequence[str] = (),
        role: Role | None = None,
        cost: PredictCost | None = None,
    ) -> list[tuple[Instance, int]]:
        """Each live instance (of ``role``, among ``instance_ids`` when given), sorted by id, with
        the leading tokens of ``prompt`` (token ids, or chains hashed by the caller) it holds."""
        cost = cost if cost is not None else PredictCost()
        wanted = set(instance_ids)
        chains: dict[int, bytes] = {}
        for _ in range(_ATTEMPTS):
            if self._view is None:
                t0 = time.perf_counter()
                self._view = await self._registry.list()
                cost.registry += time.perf_counter() - t0
                cost.refreshes += 1
                if self._runs is not None:
                    self._runs.keep_only({i.ref.instance_id for i in self._view})
            view = self._view
            probed = [i for i in view if not wanted or i.ref.instance_id in wanted]
            searched = [role is None or i.ref.role is role for i in probed]
            t0 = time.perf_counter()
            for inst, search in zip(probed, searched):
                if search and inst.block_size not in chains:
                    chains[inst.block_size] = prompt_chain(prompt, inst.block_size, salt)
            cost.hashing += time.perf_counter() - t0
            guesses = [0] * len(probed)
            if self._runs is not None:
                for k, (inst, search) in enumerate(zip(probed, searched)):
                    if search:
                        guesses[k] = self._runs.guess(inst.ref.instance_id, chains[inst.block_size])
                cost.guessed = sum(1 for g in guesses if g)
            t0 = time.perf_counter()
            answer = await self._call(view, probed, searched, guesses, chains)
            cost.index += time.perf_counter() - t0
            if answer is not None:
                if self._runs is not None:
                    for inst, n in answer:
                        if inst.block_size in chains:
                            self._runs.remember(inst.ref.instance_id, chains[inst.block_size], n)
                return [
                    (i, n * i.block_size) for i, n in answer if role is None or i.ref.role is role
                ]
            self._view = None
        # A registry changing under every attempt: list it, then search what was listed.
        t0 = time.perf_counter()
        live = await self._registry.list(role)
        cost.registry += time.perf_counter() - t0
        live = [i for i in live if not wanted or i.ref.instance_id in wanted]
        t0 = time.perf_counter()
        cached = await self._index.cached_tokens(prompt, salt, live)
        cost.index += time.perf_counter() - t0
        return [(i, cached[i.ref.instance_id]) for i in live]

    async def _call(
        self,
        view: list[Instance],
        probed: list[Instance],
        searched: list[bool],
        guesses: list[int],
        chains: dict[int, bytes],
    ) -> list[tuple[Instance, int]] | None:
        """(record now, leading blocks) of each probed instance still live; None: view stale."""
        sizes = list(chains)
        which = [sizes.index(i.block_size) + 1 if s else 0 for i, s in zip(probed, searched)]
        reg = self._registry
        if self._cluster:
            calls = [
                self._script(
                    keys=[reg.instance_key(i.ref.instance_id), reg.blocks_key(i.ref.instance_id)],
                    args=[-1, 1, chains[i.block_size], f"1 {g}"] if w else [-1, 0, "0 0"],
                )
                for i, w, g in zip(probed, which, guesses)
            ]
            ids, *replies = await asyncio.gather(self._redis.smembers(reg.ids_key), *calls)
            if {x.decode() if isinstance(x, bytes) else x for x in ids} != {
                i.ref.instance_id for i in view
            }:
                return None
            raws = [_bytes(r[1]) for r in replies]
            counts = [int(r[2] or 0) for r in replies]
        else:
            keys = [reg.ids_key]
            for i in probed:
                keys += [reg.instance_key(i.ref.instance_id), reg.blocks_key(i.ref.instance_id)]
            ids = [i.ref.instance_id for i in view]
            # NOTE: one string, not two arguments per instance: redis-py packs each in Python.
            per_instance = " ".join(f"{w} {g}" for w, g in zip(which, guesses))
            reply = await self._script(
                keys=keys,
                args=[len(ids), *ids, len(sizes), *(chains[b] for b in sizes), per_instance],
            )
            if not reply[0]:
                return None
            if not probed:
                return []
            raws = _bytes(reply[1]).split(b"\n")
            counts = [int(x) for x in _bytes(reply[2]).split(b",")]
        answer = []
        for inst, raw, n in zip(probed, raws, counts):
            if not raw:
                self._view = None  # gone: list again next time (which prunes its id)
                continue
            now = decode_record(raw)
            if now.block_size != inst.block_size or now.ref.role is not inst.ref.role:
                return None  # re-registered otherwise: searched with the wrong chain, or not at all
            answer.append((now, n))
        return answer
