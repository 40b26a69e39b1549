"""RadixCache: prefix matching over full blocks, ownership, LRU eviction, locks and events."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdd.core.block_hash import ROOT_HASH, block_hash, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.engine.block_pool import BlockPool, PoolExhaustedError
from pdd.engine.radix_cache import RadixCache

BS = 4


@pytest.fixture
def events() -> list[CacheEvent]:
    return []


@pytest.fixture
def cache(events) -> RadixCache:
    return RadixCache(BlockPool(64), BS, on_event=events.append)


def put(cache: RadixCache, tokens: list[int], salt: str = ""):
    """Allocate blocks for ``tokens`` (tail included) and insert them, like a finished prefill."""
    blocks = cache.allocate(-(-len(tokens) // BS))
    return blocks, cache.insert(tokens, blocks, salt)


def test_match_insert_round_trip(cache):
    tokens = list(range(10))  # 2 full blocks + 2-token tail
    blocks, res = put(cache, tokens)
    assert res.blocks == blocks[:2] and res.num_new_tokens == 8
    m = cache.match(tokens)
    assert (m.blocks, m.num_tokens) == (blocks[:2], 8)
    assert cache.match_len(tokens + [99] * 8) == 8
    diverging = tokens[:4] + [50, 51, 52, 53]
    m2 = cache.match(diverging)  # splits the 2-block node
    assert (m2.blocks, m2.num_tokens) == (blocks[:1], 4)
    assert cache.match(tokens).blocks == blocks[:2]
    assert cache.match([]).num_tokens == 0
    cache.check_integrity()


def test_partial_block_is_not_cached_and_stays_with_caller(cache):
    blocks, res = put(cache, list(range(7)))
    assert res.blocks == blocks[:1] and res.num_new_tokens == 4
    assert cache.cached_blocks == 1
    assert cache.match(list(range(3))).num_tokens == 0
    assert cache.match_len(list(range(7))) == 4
    cache.evict(100)
    assert not cache.pool.is_free(blocks[1])  # the tail is the caller's, never the cache's
    assert cache.pool.num_free == 64 - 1
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), blocks[:1])


def test_salts_never_share(cache):
    tokens = list(range(8))
    blocks, _ = put(cache, tokens, salt="a")
    assert cache.match(tokens, salt="b").num_tokens == 0
    assert cache.match(tokens).num_tokens == 0
    assert cache.match(tokens, salt="a").blocks == blocks
    other, res = put(cache, tokens, salt="b")
    assert res.blocks == other and res.num_new_tokens == 8
    assert set(cache.all_block_hashes()) == set(chain_hashes(tokens, BS, "a")) | set(
        chain_hashes(tokens, BS, "b")
    )
    cache.check_integrity()


def test_duplicate_insert_returns_canonical_blocks_and_frees_duplicates(cache, events):
    tokens = list(range(12))
    first, _ = put(cache, tokens)
    free_before = cache.pool.num_free
    dup = cache.allocate(3)
    res = cache.insert(tokens, dup)
    assert res.blocks == first and res.num_new_tokens == 0
    assert cache.pool.num_free == free_before
    assert all(cache.pool.is_free(b) for b in dup)
    assert [e.kind for e in events] == ["stored"]  # nothing new, no event
    # Shares the first block only: one duplicate freed, one block newly owned.
    partial = cache.allocate(2)
    res = cache.insert(tokens[:4] + [70, 71, 72, 73], partial)
    assert res.blocks == [first[0], partial[1]] and res.num_new_tokens == 4
    assert cache.pool.is_free(partial[0]) and not cache.pool.is_free(partial[1])
    assert cache.cached_blocks == 4
    cache.check_integrity()


def test_insert_rejects_blocks_that_are_free_or_cached_elsewhere(cache):
    blocks, _ = put(cache, list(range(8)))
    with pytest.raises(ValueError):
        cache.insert([9] * 4, [blocks[1]])  # owned by the cache at another position
    with pytest.raises(ValueError):
        cache.insert([9] * 4, [60])  # free in the pool
    cache.check_integrity()


def test_eviction_is_lru_and_parents_go_after_children(cache, events):
    a, b, c = [[i] * 8 for i in (1, 2, 3)]
    for tokens in (a, b, c):
        put(cache, tokens)
    cache.match(a)
    events.clear()
    assert cache.evict(2) == 2
    assert events[-1].block_hashes == tuple(chain_hashes(b, BS))
    assert cache.evict(1) == 2  # whole nodes: c
    assert events[-1].block_hashes == tuple(chain_hashes(c, BS))
    assert cache.match_len(a) == 8
    # shared prefix: children leave before their parent
    put(cache, [5] * 4 + [6] * 4)
    put(cache, [5] * 4 + [7] * 4)
    cache.match(a)
    events.clear()
    assert cache.evict(100) == 5
    order = [e.block_hashes for e in events]
    assert order[:2] == [
        (chain_hashes([5] * 4 + [6] * 4, BS)[1],),
        (chain_hashes([5] * 4 + [7] * 4, BS)[1],),
    ]
    assert order[2:] == [tuple(chain_hashes([5] * 4, BS)), tuple(chain_hashes(a, BS))]
    assert cache.cached_blocks == 0 and cache.pool.num_free == 64
    cache.check_integrity()


def test_locked_blocks_are_never_evicted(cache):
    tokens = list(range(12))
    blocks, _ = put(cache, tokens)
    put(cache, list(range(100, 108)))
    m = cache.match(tokens[:8])  # splits: locks only the first two blocks
    cache.lock(m.handle)
    assert cache.evictable_blocks == 3
    assert cache.evict(100) == 3
    assert not any(cache.pool.is_free(b) for b in blocks[:2])
    assert cache.pool.is_free(blocks[2])
    assert cache.match(tokens).blocks == blocks[:2]
    with pytest.raises(PoolExhaustedError):
        cache.allocate(63)
    cache.unlock(m.handle)
    with pytest.raises(ValueError):
        cache.unlock(m.handle)
    assert cache.evict(100) == 2
    with pytest.raises(ValueError):
        cache.lock(m.handle)  # evicted: the handle is stale
    cache.check_integrity()


def test_allocate_evicts_only_when_short_and_only_if_enough(events):
    cache = RadixCache(BlockPool(8), BS, on_event=events.append)
    put(cache, [1] * 12)
    put(cache, [2] * 12)
    assert cache.pool.num_free == 2
    with pytest.raises(PoolExhaustedError) as info:
        cache.allocate(9)
    assert info.value.free == 8 and cache.cached_blocks == 6  # nothing evicted in vain
    got = cache.allocate(4)
    assert len(got) == 4 and cache.cached_blocks == 3
    assert [e.kind for e in events] == ["stored", "stored", "evicted"]
    assert events[-1].block_hashes == tuple(chain_hashes([1] * 12, BS))
    cache.check_integrity()


def test_stored_events_carry_chained_hashes_and_tokens(cache, events):
    base = list(range(8))
    put(cache, base + [1, 2, 3], salt="t")
    longer = base + list(range(20, 28))
    put(cache, longer, salt="t")
    full = chain_hashes(longer, BS, "t")
    assert events[0] == CacheEvent(
        "stored", tuple(chain_hashes(base, BS, "t")), ROOT_HASH, "t", BS, tuple(base)
    )
    assert events[1] == CacheEvent("stored", tuple(full[2:]), full[1], "t", BS, tuple(longer[8:]))
    assert cache.all_block_hashes() == full


def test_reset_drops_unlocked_nodes_and_reports_them(cache, events):
    keep, _ = put(cache, list(range(8)))
    gone, _ = put(cache, list(range(50, 58)), salt="x")
    cache.lock(cache.match(list(range(8))).handle)
    events.clear()
    cache.reset()
    assert [(e.kind, e.block_hashes) for e in events] == [
        ("cleared", tuple(chain_hashes(list(range(50, 58)), BS, "x")))
    ]
    assert all(cache.pool.is_free(b) for b in gone)
    assert cache.cached_blocks == 2 and cache.match_len(list(range(8))) == 8
    cache.check_integrity()


def test_check_integrity_catches_corruption(cache):
    blocks, res = put(cache, list(range(8)))
    cache.check_integrity()
    cache.pool.free(blocks[:1])
    with pytest.raises(RuntimeError, match="free in the pool"):
        cache.check_integrity()
    cache.pool.allocate(1)
    res.handle.hashes[1] ^= 1
    with pytest.raises(RuntimeError, match="chain"):
        cache.check_integrity()
    res.handle.hashes[1] ^= 1
    res.handle.ref = 1  # bypasses the evictable counter
    with pytest.raises(RuntimeError, match="evictable"):
        cache.check_integrity()


# ---- randomized: long operation sequences against a hash-set reference ----------------

TOKENS = st.lists(st.integers(0, 2), max_size=14)
SALTS = st.sampled_from(["", "t"])


class CacheMachine(RuleBasedStateMachine):
    """Reference: the set of cached hashes, kept only from events. A prefix of k full blocks
    is cached iff its k-th chained hash is in the set (the tree is prefix-closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24)
        self.bs = 2
        self.cache = RadixCache(self.pool, self.bs, on_event=self.on_event)
        self.hashes: set[int] = set()
        self.held: list[int] = []  # tail blocks and raw allocations the test owns
        self.locks: list[tuple[object, list[int]]] = []

    def on_event(self, e: CacheEvent) -> None:
        assert e.block_size == self.bs
        if e.kind == "stored":
            assert not self.hashes & set(e.block_hashes)
            assert e.parent_hash == ROOT_HASH or e.parent_hash in self.hashes
            assert len(e.token_ids) == len(e.block_hashes) * self.bs
            parent = e.parent_hash
            for j, h in enumerate(e.block_hashes):
                parent = block_hash(parent, e.token_ids[j * self.bs : (j + 1) * self.bs], e.salt)
                assert h == parent
            self.hashes |= set(e.block_hashes)
        else:
            assert set(e.block_hashes) <= self.hashes
            self.hashes -= set(e.block_hashes)

    def expected_len(self, tokens: list[int], salt: str) -> int:
        k = 0
        for h in chain_hashes(tokens, self.bs, salt):
            if h not in self.hashes:
                break
            k += 1
        return k * self.bs

    @rule(tokens=TOKENS, salt=SALTS, lock=st.booleans())
    def insert(self, tokens, salt, lock):
        n = -(-len(tokens) // self.bs)
        available = self.pool.num_free + self.cache.evictable_blocks
        try:
            blocks = self.cache.allocate(n)
        except PoolExhaustedError:
            assert n > available
            return
        n_full = len(tokens) // self.bs
        res = self.cache.insert(tokens, blocks, salt)
        self.held += blocks[n_full:]
        assert len(res.blocks) == n_full
        assert self.cache.match_len(tokens, salt) == n_full * self.bs
        assert self.cache.match(tokens, salt).blocks == res.blocks
        if lock:
            self.cache.lock(res.handle)
            self.locks.append((res.handle, res.blocks))

    @rule(tokens=TOKENS, salt=SALTS)
    def match_and_lock(self, tokens, salt):
        expected = self.expected_len(tokens, salt)
        assert self.cache.match_len(tokens, salt) == expected
        m = self.cache.match(tokens, salt)
        assert m.num_tokens == expected == len(m.blocks) * self.bs
        self.cache.lock(m.handle)
        self.locks.append((m.handle, m.blocks))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        handle, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(handle)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        free, evictable = self.pool.num_free, self.cache.evictable_blocks
        freed = self.cache.evict(n)
        assert self.pool.num_free == free + freed
        assert freed == evictable if evictable <= n else n <= freed <= evictable

    @rule(n=st.integers(0, 8))
    def allocate(self, n):
        try:
            self.held += self.cache.allocate(n)
        except PoolExhaustedError:
            assert n > self.pool.num_free + self.cache.evictable_blocks

    @precondition(lambda self: self.held)
    @rule()
    def release_held(self):
        self.pool.free(self.held)
        self.held = []

    @rule()
    def reset(self):
        locked = {b for _, blocks in self.locks for b in blocks}
        self.cache.reset()
        assert self.cache.cached_blocks == len(locked)

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        assert self.pool.num_free + self.cache.cached_blocks + len(self.held) == 24
        assert set(self.cache.all_block_hashes()) == self.hashes
        for _, blocks in self.locks:
            assert not any(self.pool.is_free(b) for b in blocks)


CacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
