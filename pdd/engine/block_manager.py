"""``BlockManager``: a sequence's block table against the block pool and the radix prefix cache.

- ``match``: on admission, the longest cached prefix of the known tokens minus
  the last one (whose logits we need) becomes the head of the block table,
  locked so it cannot be evicted while in use.
- ``ensure``: grow the block table to hold ``n`` tokens (the cache evicts LRU
  unlocked blocks when the pool is short; ``PoolExhaustedError`` otherwise).
- ``cache``: insert the computed full blocks; the cache owns them from then on,
  and our duplicates of blocks it already had are swapped for its ids.
- ``release``: cache, unlock, free what the sequence still owns.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pdd.core.cache_event import CacheEvent
from pdd.engine.block_pool import BlockPool
from pdd.engine.radix_cache import RadixCache
from pdd.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: Callable[[CacheEvent], None] | None = None,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size, on_event)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_free

    def match(self, seq: Sequence) -> None:
        """Take the cached prefix of ``seq``'s known tokens (all but the last) as computed."""
        if seq.block_table or seq.cache_handle is not None:
            raise RuntimeError(f"{seq.request_id}: match on a sequence that still holds KV")
        seq.num_computed = 0
        # NOTE: a request scoring its prompt computes every position: a cached prefix has no logits
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return
        hit = self.cache.match(seq.token_ids[:-1], seq.salt)
        self.cache.lock(hit.handle)
        seq.cache_handle = hit.handle
        seq.block_table = list(hit.blocks)
        seq.num_cached_blocks = len(hit.blocks)
        seq.num_computed = hit.num_tokens

    def prefix_match_len(self, token_ids: Seq[int], salt: str = "") -> int:
        return self.cache.match_len(token_ids, salt) if self.enable_prefix_caching else 0

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table hold ``num_tokens`` tokens (all or nothing)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.cache.allocate(need))

    def cache_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Insert the full blocks of the first ``num_tokens`` (default: all computed) tokens."""
        if not self.enable_prefix_caching:
            return
        upto = seq.num_computed if num_tokens is None else min(num_tokens, seq.num_computed)
        n_full = upto // self.block_size
        if n_full <= seq.num_cached_blocks:
            return
        res = self.cache.insert(
            seq.token_ids[: n_full * self.block_size], seq.block_table[:n_full], seq.salt
        )
        self.cache.lock(res.handle)
        if seq.cache_handle is not None:
            self.cache.unlock(seq.cache_handle)
        seq.cache_handle = res.handle
        seq.block_table[:n_full] = res.blocks
        seq.num_cached_blocks = n_full

    def release(self, seq: Sequence) -> None:
        """Give up all of ``seq``'s KV: computed full blocks stay in the cache (unlocked)."""
        self.cache_blocks(seq)
        if seq.cache_handle is not None:
            self.cache.unlock(seq.cache_handle)
        self.pool.free(seq.block_table[seq.num_cached_blocks :])
        seq.block_table, seq.num_cached_blocks, seq.cache_handle, seq.num_computed = [], 0, None, 0

    def rollback(self, seq: Sequence, num_tokens: int) -> bool:
        """Keep K/V only for tokens ``< num_tokens``; True when everything was released instead.

        Within the sequence's own blocks this is just a counter; a cut inside cached
        blocks (which are never rewritten) releases the sequence, and the caller
        re-``match``es it after changing its tokens (the cache still has the old blocks).
        """
        if num_tokens >= seq.num_computed:
            return False
        if num_tokens >= seq.num_cached_blocks * self.block_size:
            seq.num_computed = num_tokens
            return False
        self.release(seq)
        return True

    def slots(self, seq: Sequence, start: int, end: int, scratch: int | None = None) -> list[int]:
        """Slots of positions ``[start, end)``; positions in cached blocks map to ``scratch`` if given."""
        bs, table = self.block_size, seq.block_table
        shared = seq.num_cached_blocks * bs if scratch is not None else 0
        return [scratch if p < shared else table[p // bs] * bs + p % bs for p in range(start, end)]
