"""What an engine's prefix cache reports to the index: blocks stored, evicted or cleared."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEvent:
    """Blocks stored in / evicted from / cleared out of the cache, named by chained hash."""

    kind: str  # "stored" | "evicted" | "cleared"
    block_hashes: tuple[int, ...]
    parent_hash: int  # chained hash of the block before the first one; ROOT_HASH at the root
    salt: str
    block_size: int
    token_ids: tuple[int, ...] = ()  # "stored" only: the stored blocks' tokens, in order
