"""The prefix index on a real Redis: the O(log blocks) prediction agrees with the per-block
reference and with a model of what each instance's radix cache can match, on random holdings
(predicted between the changes too, so the searches start from stale remembered runs);
a block evicted from the middle of a chain takes the blocks after it along (never over-counted);
cache events are sequenced (a gap asks for a resync, a retried batch is not applied twice), and
membership answers kvstore's resync request with a snapshot at once. The registry view kvstore
keeps never answers an instance deregistered or lapsed, even by another kvstore, and follows
re-registrations, new instances and heartbeats."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from pdd.core.block_hash import ROOT_HASH, PromptChains, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.errors import FailedPreconditionError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.prefix_index.live_predict import PredictCost
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

            async def agree(q: list[int]) -> None:
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
                # The prompt hashed by the caller (as the gateway sends it): the same answer.
                chains = PromptChains.of(q, [BS], SALT)
                hashed = {
                    h.instance.ref.instance_id: (h.cached_tokens, h.hit_rate)
                    for h in await store.predict(chains, SALT)
                }
                assert hashed == {i: (n, n / len(q)) for i, n in want.items()}, (q, hashed)
                # The plain search too (listed instances, no guess): the predictor's fallback.
                assert await store.index.cached_tokens(q, SALT, insts) == want
                assert await store.index.cached_tokens(chains, SALT, insts) == want

            for op, k, tokens, at in ops:
                blocks = len(tokens) // BS
                if op == "store":
                    ev = _stored(tokens, min(at, blocks - 1) if at % 2 else 0)
                else:
                    block = blocks - 1 if op == "evict_leaf" else min(at, blocks - 1)
                    ev = _evicted(tokens, block)
                models[k].apply(ev)
                await store.publish(insts[k].ref.instance_id, [ev])
                # NOTE: remembered from the answer before the change: the next search's guess.
                await agree(tokens)
            # NOTE: the prompts the events were about are where holes and orphans show.
            for q in [tokens for _, _, tokens, _ in ops] + queries:
                await agree(q)
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
    hashed = await store.predict(PromptChains.of(prompt, (8, 2), SALT), SALT)
    assert {h.instance.ref.instance_id: h.cached_tokens for h in hashed} == hits
    # A chain short of one live block size: the caller must send the tokens.
    with pytest.raises(FailedPreconditionError, match="block size 8"):
        await store.predict(PromptChains.of(prompt, (2,), SALT), SALT)
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


async def test_a_remembered_run_that_went_stale_only_moves_where_the_search_starts(redis_url):
    store = await _store(redis_url)
    prompt = list(range(40))  # 20 blocks of 2
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    await store.publish("md-0", [_stored(prompt)])

    async def held(q: list[int]) -> tuple[int, int]:
        cost = PredictCost()
        [hit] = await store.predict(q, SALT, cost=cost)
        [ref] = await store.predict(q, SALT, reference=True)
        assert hit.cached_tokens == ref.cached_tokens
        return hit.cached_tokens, cost.guessed

    assert await held(prompt) == (40, 0)  # nothing remembered yet
    assert await held(prompt) == (40, 1)  # the run of 20 blocks, right
    await store.publish("md-0", [_evicted(prompt, 7)])
    assert await held(prompt) == (14, 1)  # 20 guessed, 7 held
    await store.publish("md-0", [_stored(prompt, start_block=7)])
    assert await held(prompt) == (40, 1)  # 7 guessed, 20 held
    longer = prompt + list(range(100, 120))  # the prompt, then 10 blocks nobody holds
    assert await held(longer) == (40, 1)
    other = prompt[:10] + list(range(200, 230))  # shares 5 blocks: no remembered run fits
    assert await held(other) == (10, 0)
    await store.redis.aclose()


async def _two_kvstores(redis_url: str) -> tuple[PrefixStore, PrefixStore]:
    """Two stores on one Redis and one prefix: kvstore replicas, each with its own view."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    return PrefixStore(Redis.from_url(redis_url), prefix), PrefixStore(
        Redis.from_url(redis_url), prefix
    )


async def _answer(store: PrefixStore, prompt: list[int], **kw) -> dict[str, int]:
    hits = await store.predict(prompt, SALT, **kw)
    return {h.instance.ref.instance_id: h.cached_tokens for h in hits}


async def test_the_view_never_answers_an_instance_gone_behind_its_back(redis_url):
    """Deregistered by another kvstore, lapsed, or the whole registry gone (Redis restarted):
    the next answer of a kvstore whose view still lists the instance leaves it out."""
    a, b = await _two_kvstores(redis_url)
    prompt = list(range(20))
    for iid in ("md-0", "md-1"):
        await b.register(_inst(iid), 60_000, reset_index=True)
        await b.publish(iid, [_stored(prompt)])
    await b.register(_inst("md-2"), 1500, reset_index=True)  # a short lease, never renewed
    assert await _answer(a, prompt) == {"md-0": 20, "md-1": 20, "md-2": 0}
    await b.deregister("md-1")
    costs = [PredictCost(), PredictCost()]
    assert await _answer(a, prompt, cost=costs[0]) == {"md-0": 20, "md-2": 0}
    assert await _answer(a, prompt, cost=costs[1]) == {"md-0": 20, "md-2": 0}
    assert [c.refreshes for c in costs] == [1, 0]  # the id set changed: listed again, once
    await asyncio.sleep(1.6)  # md-2's lease lapses inside Redis: nobody writes anything
    costs = [PredictCost(), PredictCost()]
    assert await _answer(a, prompt, cost=costs[0]) == {"md-0": 20}
    assert await _answer(a, prompt, cost=costs[1]) == {"md-0": 20}
    # Its record was found gone in the call; the id, still listed, is pruned by the next listing.
    assert [c.refreshes for c in costs] == [0, 1]
    assert not await a.heartbeat("md-2", InstanceLoad())  # and a late heartbeat does not revive it
    assert await _answer(a, prompt) == {"md-0": 20}
    for iid in await a.redis.keys(f"{a.registry.ids_key.partition(':')[0]}:*"):
        await a.redis.delete(iid)
    assert await _answer(a, prompt) == {}
    await a.redis.aclose()
    await b.redis.aclose()


async def test_the_view_follows_registrations_heartbeats_and_new_block_sizes(redis_url):
    a, b = await _two_kvstores(redis_url)
    prompt = list(range(32))
    await b.register(_inst("md-0"), 60_000, reset_index=True)
    await b.publish("md-0", [_stored(prompt)])
    assert await _answer(a, prompt) == {"md-0": 32}
    # A heartbeat's load is in the next answer, without listing the registry again.
    assert await b.heartbeat("md-0", InstanceLoad(running_requests=7))
    cost = PredictCost()
    [hit] = await a.predict(prompt, SALT, cost=cost)
    assert (hit.instance.load.running_requests, cost.refreshes) == (7, 0)
    # A new instance is answered at once.
    await b.register(_inst("md-1", 8), 60_000, reset_index=True)
    await b.publish("md-1", [_stored(prompt[:16], bs=8)])
    assert await _answer(a, prompt) == {"md-0": 32, "md-1": 16}
    # Re-registered as a prefill of block size 4: searched with its new chain, filtered by role.
    await b.register(
        Instance(InstanceRef("md-0", "127.0.0.1:1", Role.PREFILL), 4, "m"), 60_000, reset_index=True
    )
    await b.publish("md-0", [_stored(prompt[:24], bs=4)])
    assert await _answer(a, prompt) == {"md-0": 24, "md-1": 16}
    assert await _answer(a, prompt, role=Role.MAIN_DECODE) == {"md-1": 16}
    assert await _answer(a, prompt, role=Role.PREFILL) == {"md-0": 24}
    assert await _answer(a, prompt, instance_ids=["md-1", "ghost"]) == {"md-1": 16}
    await a.redis.aclose()
    await b.redis.aclose()


async def test_predictions_stay_exact_while_other_instances_come_and_go(redis_url):
    a, b = await _two_kvstores(redis_url)
    prompt = list(range(40))
    for k in range(3):
        await b.register(_inst(f"md-{k}"), 60_000, reset_index=True)
        await b.publish(f"md-{k}", [_stored(prompt[: 10 * (k + 1)])])
    stable = {"md-0": 10, "md-1": 20, "md-2": 30}
    done = asyncio.Event()

    async def churn() -> None:
        k = 0
        while not done.is_set():
            await b.register(_inst(f"churn-{k % 3}"), 60_000, reset_index=True)
            await b.deregister(f"churn-{(k + 1) % 3}")
            k += 1

    task = asyncio.create_task(churn())
    refreshes = 0
    try:
        for _ in range(60):
            cost = PredictCost()
            got = await _answer(a, prompt, cost=cost)
            refreshes += cost.refreshes
            assert {i: n for i, n in got.items() if i in stable} == stable
            assert all(n == 0 for i, n in got.items() if i not in stable), got
    finally:
        done.set()
        await task
    assert refreshes > 0
    for k in range(3):
        await b.deregister(f"churn-{k}")
    assert await _answer(a, prompt) == stable
    await a.redis.aclose()
    await b.redis.aclose()


async def test_a_registry_no_view_can_match_is_listed_then_searched(redis_url):
    """A record filed under another id's key (written by hand: the API cannot) makes every view
    stale; after a few tries the answer is the plain one, list then search."""
    store = await _store(redis_url)
    prompt = list(range(20))
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    await store.publish("md-0", [_stored(prompt)])
    raw = await store.redis.get(store.registry.instance_key("md-0"))
    await store.redis.sadd(store.registry.ids_key, "alias")
    await store.redis.set(store.registry.instance_key("alias"), raw.replace(b"md-0", b"other"))
    cost = PredictCost()
    hits = await store.predict(prompt, SALT, cost=cost)
    assert [(h.instance.ref.instance_id, h.cached_tokens) for h in hits] == [
        ("other", 0),
        ("md-0", 20),
    ]
    assert cost.refreshes == 3
    await store.redis.aclose()


async def test_an_instance_unlisted_by_a_racing_list_is_listed_again_by_its_heartbeat(redis_url):
    store = await _store(redis_url)
    prompt = list(range(8))
    await store.register(_inst("md-0"), 60_000, reset_index=True)
    await store.publish("md-0", [_stored(prompt)])
    # What a ``list`` that ran between a registration's two writes would do: prune the id.
    await store.redis.srem(store.registry.ids_key, "md-0")
    assert await _answer(store, prompt) == {}
    assert await store.heartbeat("md-0", InstanceLoad())
    assert await _answer(store, prompt) == {"md-0": 8}
    await store.redis.aclose()
