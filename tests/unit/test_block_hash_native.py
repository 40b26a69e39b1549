"""The fast chained hash (C where a compiler is at hand, else hashlib over one buffer) is the
definition's exact value, block for block: a second hash would make predicted hits disagree."""

from __future__ import annotations

import shutil
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.core import block_hash_native
from pdd.core.block_hash import (
    _chain_hashlib,
    chain_hash_bytes,
    chain_hashes,
    chain_hashes_reference,
)

TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=300)
SALTS = st.text(max_size=70)  # past one 128-byte BLAKE2b block with a long salt and block


def _ints(chain: bytes) -> list[int]:
    return [int.from_bytes(chain[i : i + 8], "little") for i in range(0, len(chain), 8)]


@pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler: the hashlib path serves (tested below)",
)
def test_the_native_chain_is_built_where_there_is_a_compiler():
    assert block_hash_native.load() is not None


@settings(max_examples=200, deadline=None)
@given(TOKENS, st.integers(1, 40), SALTS)
def test_native_and_hashlib_chains_equal_the_definition(tokens, block_size, salt):
    ref = chain_hashes_reference(tokens, block_size, salt)
    assert chain_hashes(tokens, block_size, salt) == ref
    assert _ints(chain_hash_bytes(tokens, block_size, salt)) == ref
    # kvstore's requests arrive as array("I"), partial tail block included
    assert _ints(chain_hash_bytes(array("I", tokens), block_size, salt)) == ref
    whole = len(tokens) // block_size * block_size
    packed = array("I", tokens[:whole]).tobytes()
    assert _ints(_chain_hashlib(packed, block_size, salt.encode())) == ref
    lib = block_hash_native.load()
    if lib is not None:
        native = block_hash_native.chain_bytes(lib, packed, block_size, salt.encode(), 0)
        assert _ints(native) == ref


def test_a_64k_prompt_has_4096_hashes_and_a_partial_block_none():
    tokens = list(range(65536 + 15))
    chain = chain_hash_bytes(tokens, 16)
    assert len(chain) == 4096 * 8
    assert _ints(chain)[-1] == chain_hashes_reference(tokens, 16)[-1]
    assert chain_hash_bytes(tokens[:15], 16) == b""
