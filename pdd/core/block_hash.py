"""The one block-hash function of the project.

A KV block of ``block_size`` tokens is named by a chained hash: the hash of the
previous block, the cache salt (tenant isolation) and the block's token ids.
Equal hashes therefore mean an equal *prefix*, not just an equal block, which
is what the prefix index (kvstore) and every radix cache need to agree on.

NOTE: the engine's radix cache (cache events), the kvstore index and the
gateway's predictions must all call this module; a second implementation would
silently make predicted hits disagree with actual ones.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# NOTE: the root "parent" of the first block; any fixed value works as long as
# every process uses the same one.
ROOT_HASH = 0


def block_hash(parent: int, tokens: Sequence[int], salt: str = "") -> int:
    """Hash one full block chained to ``parent``; returns an unsigned 64-bit int."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    salt_bytes = salt.encode("utf-8")
    h.update(struct.pack("<I", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of every *full* block of ``tokens`` (a partial tail block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
