import pytest

from pdd.core.block_hash import (
    ROOT_HASH,
    PromptChains,
    block_hash,
    chain_hash_bytes,
    chain_hashes,
    prompt_chain,
)
from pdd.core.errors import FailedPreconditionError


def test_chain_covers_full_blocks_only():
    tokens = list(range(37))
    hashes = chain_hashes(tokens, 16)
    assert len(hashes) == 2
    assert hashes[0] == block_hash(ROOT_HASH, tokens[:16])
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])


def test_hash_names_the_whole_prefix_not_just_the_block():
    a = chain_hashes([1] * 16 + [7] * 16, 16)
    b = chain_hashes([2] * 16 + [7] * 16, 16)
    assert a[1] != b[1]  # same last block, different prefix


def test_salt_isolates_tenants():
    tokens = list(range(32))
    assert chain_hashes(tokens, 16, "tenant-a") != chain_hashes(tokens, 16, "tenant-b")
    assert chain_hashes(tokens, 16, "") == chain_hashes(tokens, 16)


def test_hash_is_stable_and_64_bit():
    # NOTE: a changed hash function silently breaks every persisted index; pin one value.
    h = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert 0 <= h < 2**64
    assert h == block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert h != block_hash(ROOT_HASH, [1, 2, 3, 5])


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes([1, 2], 0)


def test_prompt_chains_are_the_chains_of_the_tokens_and_say_what_they_lack():
    tokens = list(range(1000, 1037))
    p = PromptChains.of(tuple(tokens), [8, 4, 8], "s")
    assert (len(p), sorted(p.chains)) == (37, [4, 8])
    for bs in (4, 8):
        assert prompt_chain(p, bs, "s") == chain_hash_bytes(tokens, bs, "s")
        assert prompt_chain(tokens, bs, "s") == chain_hash_bytes(tokens, bs, "s")
    with pytest.raises(FailedPreconditionError, match="block size 16"):
        prompt_chain(p, 16, "s")
    with pytest.raises(ValueError, match=r"chains\[4\]"):
        PromptChains(37, {4: p.chains[4][:-8]})
