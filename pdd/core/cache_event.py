"""What an engine's prefix cache reports to the index (blocks stored, evicted or cleared), and what
the index answers to a batch of them."""

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


@dataclass(frozen=True)
class PublishResult:
    """What kvstore did with one batch of cache events."""

    applied: int
    # True: the batch came after a gap in the instance's sequence; nothing of it was applied and
    # the instance must republish its whole cache (re-register with a reset index + snapshot).
    resync: bool = False

    def __post_init__(self) -> None:
        if self.applied < 0:
            raise ValueError(f"applied: must be >= 0, got {self.applied}")
