"""BlockPool: all-or-nothing allocation, exhaustion errors and strict frees."""

from __future__ import annotations

import pytest

from pdd.engine.block_pool import BlockPool, PoolExhaustedError


def test_allocate_gives_distinct_ids_and_counts_down():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8
    assert set(a + b) == set(range(8))
    assert pool.num_free == 0
    assert pool.allocate(0) == []


def test_exhaustion_raises_with_requested_and_free_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "2" in str(info.value) and "1" in str(info.value)
    assert pool.num_free == 1
    assert len(pool.allocate(1)) == 1


def test_free_returns_blocks_for_reuse():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks[:2])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(blocks[:2])
    assert pool.is_free(blocks[0]) is False


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_free_out_of_range_is_rejected(bad):
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([bad])
    assert pool.num_free == 0


def test_double_free_is_rejected():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free([blocks[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[0]])
    assert pool.num_free == 3


def test_free_is_all_or_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a, b, a])
    assert pool.num_free == 2
    assert not pool.is_free(a) and not pool.is_free(b)


def test_negative_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockPool(-1)
    with pytest.raises(ValueError):
        BlockPool(4).allocate(-1)
