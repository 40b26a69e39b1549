"""The prefix index on a real Redis: the O(log blocks) prediction agrees with the per-block
reference and with a model of what each instance's radix cache can match, on random holdings;
a block evicted from the middle of a chain takes the blocks after it along (never over-counted);
cache events are sequenced (a gap asks for a resync, a retried batch is not applied twice), and
membership answers kvstore's resync request with a snapshot at once."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from pdd.core.block_hash import ROOT_HASH, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.prefix_index.store import PrefixStore
from pdd.serving.membership import Membership

BS = 2
SALT = "s"


def _inst(instance_id: str, block_size: int = BS) -> Instance:
    return Instance(InstanceRef(instance_id, "127.0.0.1:1", Role.MAIN_DECODE), block_size, "m")


def _stored(tokens: list[int], start_block: int = 0, bs: int = BS) -> CacheEvent:
    chain = chain_hashes(tokens, bs, SALT)
    parent = chain[start_block - 1] if start_block else ROOT_HASH
    return CacheEvent(
        "stored", tuple(chain[start_block:]), parent, SALT, bs, tuple(tokens[start_block * bs :])
    )


def _evicted(tokens: list[int], block: int) -> CacheEvent:
    chain = chain_hashes(tokens, BS, SALT)
    return CacheEvent(
        "evicted", (chain[block],), chain[block - 1] if block else ROOT_HASH, SALT, BS
    )


class CacheModel:
    """What a radix cache can match after the same events: a block counts only under its parent."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def apply(self, ev: CacheEvent) -> None:
        if ev.kind == "stored":
            p = ev.parent_hash
            for h in ev.block_hashes:
                if p != ROOT_HASH and p not in self.parent:
                    break
                self.parent.setdefault(h, p)
                p = h
        else:
            gone = set(ev.block_hashes) & self.parent.keys()
            while gone:
                for h in gone:
                    del self.parent[h]
                gone = {h for h, p in self.parent.items() if p in gone}

    def leading(self, tokens: list[int]) -> int:
        n = 0
        for h in chain_hashes(tokens, BS, SALT):
            if h not in self.parent:
                break
            n += 1
        return n * BS


PROMPTS = st.lists(st.integers(0, 2), min_size=BS, max_size=10 * BS)


async def _store(redis_url: str) -> PrefixStore:
    return PrefixStore(Redis.from_url(redis_url), f"t{uuid.uuid4().hex[:12]}")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "store", "evict_leaf", "evict_any"]),
            st.integers(0, 2),
            PROMPTS,
            st.integers(0, 9),
        ),
        max_size=25,
    ),
    queries=st.lists(PROMPTS, min_size=1, max_size=6),
)
def test_binary_search_agrees_with_the_reference_and_the_model(redis_url, ops, queries):
    """Random stores (each a stored prompt prefix, chained to what is held or orphaned) and
    evictions — of a leaf (the radix cache's LRU order, the invariant kept) or of any block
    (forced, violating it): both counts equal the model's, which never counts past a hole."""

    async def run() -> None:
        store = await _store(redis_url)
        try:
            insts = [_inst(f"i{k}") for k in range(3)]
            for inst in insts:
                await store.register(inst, 60_000, reset_index=True)
            models = [CacheModel() for _ in insts]
            for op, k, tokens, at in ops:
                blocks = len(tokens) // BS
                if op == "store":
                    ev = _stored(tokens, min(at, blocks - 1) if at % 2 else 0)
                else:
                    block = blocks - 1 if op == "evict_leaf" else min(at, blocks - 1)
                    ev = _evicted(tokens, block)
                models[k].apply(ev)
                await store.publish(insts[k].ref.instance_id, [ev])
            # NOTE: the prompts the events were about are where holes and orphans show.
            for q in [tokens for _, _, tokens, _ in ops] + queries:
                fast = {
                    h.instance.ref.instance_id: h.cached_tokens
                    for h in await store.predict(q, SALT)
                }
                ref = {
                    h.instance.ref.instance_id: h.cached_tokens
                    for h in await store.predict(q, SALT, reference=True)
                }
                want = {i.ref.instance_id: m.leading(q) for i, m in zip(insts, models)}
                assert fast == ref == want, (q, fast, ref, want)
        finally:
            await store.redis.aclose()

    asyncio.run(run())


async def test_a_middle_block_evicted_by_force_is_never_counted_past(redis_url):
    store = await _store(redis_url)
    prompt = list(range(40))  # 20 blocks of 2
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    await store.publish("md-0", [_stored(prompt)])
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [40]
    # The engine drops block 7 (out of LRU order): blocks 8.. can no longer be matched.
    await store.publish("md-0", [_evicted(prompt, 7)])
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [14]
    assert [h.cached_tokens for h in await store.predict(prompt, SALT, reference=True)] == [14]
    assert await store.index.block_count("md-0") == 7  # the subtree went with it
    # A "stored" under the missing block is an orphan: not counted until its prefix returns.
    await store.publish("md-0", [_stored(prompt, start_block=10)])
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [14]
    await store.publish("md-0", [_stored(prompt, start_block=7)])
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [40]
    # Orphans where a binary search would probe them: only block 0 held under blocks 2..19.
    await store.publish("md-0", [_evicted(prompt, 1), _stored(prompt, start_block=2)])
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [2]
    assert [h.cached_tokens for h in await store.predict(prompt, SALT, reference=True)] == [2]
    await store.redis.aclose()


async def test_instances_with_other_block_sizes_are_probed_with_their_own_chain(redis_url):
    store = await _store(redis_url)
    prompt = list(range(64))
    await store.register(_inst("bs2", 2), 60_000)
    await store.register(_inst("bs8", 8), 60_000)
    await store.register(_inst("cold", 8), 60_000)
    await store.publish("bs2", [_stored(prompt[:30])])
    await store.publish("bs8", [_stored(prompt[:48], bs=8)])
    hits = {h.instance.ref.instance_id: h.cached_tokens for h in await store.predict(prompt, SALT)}
    assert hits == {"bs2": 30, "bs8": 48, "cold": 0}
    await store.redis.aclose()


async def test_a_gap_in_the_sequence_asks_for_a_resync_and_a_retry_is_applied_once(redis_url):
    store = await _store(redis_url)
    prompt = list(range(20))
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    first = await store.publish("md-0", [_stored(prompt[:8])], first_seq=1)
    assert (first.applied, first.resync) == (1, False)
    # Retried after a lost answer: seen already, not applied again (the eviction stays).
    await store.publish("md-0", [_evicted(prompt, 3)], first_seq=2)
    again = await store.publish("md-0", [_stored(prompt[:8]), _evicted(prompt, 3)], first_seq=1)
    assert (again.applied, again.resync) == (0, False)
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [6]
    # Events 3 and 4 never arrived: batch 5 is refused, nothing of it applied, a resync asked.
    gap = await store.publish("md-0", [_stored(prompt)], first_seq=5)
    assert (gap.applied, gap.resync, store.gaps) == (0, True, 1)
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [6]
    # Re-registered with a reset index, the sequence starts again at 1.
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    ok = await store.publish("md-0", [_stored(prompt)], first_seq=1)
    assert (ok.applied, ok.resync) == (1, False)
    assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [20]
    await store.redis.aclose()


class LosingKvstore:
    """The real store, but the ``lose``-th publish never reaches it (a lost batch nobody saw)."""

    def __init__(self, store: PrefixStore, lose: int) -> None:
        self.store, self.lose, self.calls = store, lose, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def publish(self, instance_id, events, *, first_seq=0):
        self.calls += 1
        if self.calls == self.lose:
            from pdd.core.cache_event import PublishResult

            return PublishResult(len(events))  # "applied", but it was not
        return await self.store.publish(instance_id, events, first_seq=first_seq)


async def test_membership_answers_kvstores_resync_request_with_a_snapshot(redis_url):
    store = await _store(redis_url)
    prompt = list(range(20))
    cache = [_stored(prompt[:10])]

    async def snapshot() -> list[CacheEvent]:
        return list(cache)

    kv = LosingKvstore(store, lose=2)
    member = Membership(kv, _inst("md-0"), ttl_ms=30_000, snapshot=snapshot)
    await member.start()
    try:
        member.publish(_stored(prompt[:16]))
        await member.flush()
        # Lost: the eviction of block 5 (the engine now holds blocks 0-4 only).
        cache[:] = [_stored(prompt[:10])]
        member.publish(_evicted(prompt, 5))
        await member.flush()
        assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [16]  # stale
        member.publish(_stored(prompt[:10]))  # the next batch shows kvstore the gap
        await member.flush()

        async def resynced() -> None:
            while member.resyncs < 1:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(resynced(), 10)  # at once, not a heartbeat period (10 s) later
        await member.flush()
        assert (member.gaps, store.gaps) == (1, 1)
        assert [h.cached_tokens for h in await store.predict(prompt, SALT)] == [10]
    finally:
        await member.stop()
        await store.redis.aclose()


@pytest.mark.parametrize("instances", [1, 5])
async def test_predict_with_no_prompt_blocks_counts_nothing(redis_url, instances):
    store = await _store(redis_url)
    for k in range(instances):
        await store.register(_inst(f"i{k}", 8), 60_000)
    hits = await store.predict([1, 2, 3])
    assert [h.cached_tokens for h in hits] == [0] * instances
    await store.redis.aclose()
