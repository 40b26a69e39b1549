"""The paged-KV block allocator: which of a fixed number of KV blocks are free.

The KV tensors themselves live with the model runner; this module hands out and
takes back block *ids* (``0 .. num_blocks-1``). Every block is, at any moment,
either free here or owned by exactly one holder: a running request's block table
or the radix prefix cache (``radix_cache.RadixCache``), which gives blocks back
when it evicts.

NOTE: ``free`` rejects double frees and unknown ids instead of ignoring them; a
silently double-freed block would later be handed to two requests at once and
corrupt their KV.
"""

from __future__ import annotations

from collections.abc import Iterable


class PoolExhaustedError(Exception):
    """Not enough free blocks for a request; carries how many were asked and available."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: requested {requested} blocks, only {free} free")
        self.requested = requested
        self.free = free


class BlockPool:
    """A free list over ``num_blocks`` block ids; allocation order is deterministic."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # NOTE: a stack popped from the end, so the lowest ids go out first and a
        # freed block is reused soonest (keeps tests and traces deterministic).
        self._free_list: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free: list[bool] = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is currently free (``ValueError`` when out of range)."""
        self._check_range(block)
        return self._is_free[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_list):
            raise PoolExhaustedError(requested=n, free=len(self._free_list))
        blocks = self._free_list[len(self._free_list) - n :][::-1]
        del self._free_list[len(self._free_list) - n :]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return ``blocks`` to the pool; all or nothing (validated before any is freed)."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            self._check_range(b)
            if self._is_free[b] or b in seen:
                raise ValueError(f"double free of KV block {b}")
            seen.add(b)
        for b in reversed(blocks):
            self._is_free[b] = True
            self._free_list.append(b)

    def _check_range(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"KV block id {block!r} out of range [0, {self.num_blocks})")
