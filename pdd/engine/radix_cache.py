"""The radix prefix cache over paged KV blocks, with ref-counts, LRU eviction and cache events.

A request's prompt is matched against a radix tree of token sequences, one
subtree per cache ``salt`` (tenants never share KV). Every edge covers a whole
number of full blocks, so a hit is always a list of block ids the request can
put at the head of its block table. After prefill the request inserts its full
blocks; the cache takes ownership of the new ones, frees the request's
duplicates of blocks it already held and hands back the canonical ids. A
running request locks its matched path so it cannot be evicted under it;
``allocate`` evicts least-recently-used unlocked leaves when the pool is short.

Every block added or dropped is reported as a ``CacheEvent`` named by the chained
hash of ``pdd.core.block_hash`` (the kvstore index is fed from these events, so the
hashes must be exactly ``chain_hashes(tokens, block_size, salt)``).

NOTE: invariants (checked by ``check_integrity``): a node's ref-count is >= each
child's; a block id is in at most one node and is never free in the pool; each
node holds ``len(blocks) * block_size`` tokens and one hash per block, chained
from its parent's last hash; ``cached_blocks``/``evictable_blocks`` equal a full walk.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from pdd.core.block_hash import ROOT_HASH, block_hash
from pdd.core.cache_event import CacheEvent
from pdd.engine.block_pool import BlockPool, PoolExhaustedError

EventSink = Callable[[CacheEvent], None]


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[int]
    num_tokens: int  # always a multiple of block_size
    handle: object  # opaque; pass to RadixCache.lock/unlock


@dataclass(frozen=True)
class InsertResult:
    handle: object
    blocks: list[int]  # canonical ids for the full-block prefix of the inserted tokens
    num_new_tokens: int


@dataclass(eq=False)
class _Node:
    """A radix-tree edge and the node below it: whole blocks, their tokens and hashes."""

    salt: str
    parent: _Node | None
    seq: int  # creation order; breaks LRU ties deterministically
    tokens: tuple[int, ...] = ()
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    ref: int = 0
    last_access: int = 0
    alive: bool = True

    @property
    def last_hash(self) -> int:
        return self.hashes[-1] if self.hashes else ROOT_HASH


class RadixCache:
    """Prefix cache over ``pool``'s blocks; ``on_event`` receives every ``CacheEvent``."""

    def __init__(self, pool: BlockPool, block_size: int, on_event: EventSink | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._on_event = on_event
        self._roots: dict[str, _Node] = {}
        self._ids = itertools.count()
        self._clock = 0
        self._cached_ids: set[int] = set()
        self._evictable = 0

    @property
    def cached_blocks(self) -> int:
        return len(self._cached_ids)

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    def match(self, token_ids: Sequence[int], salt: str = "") -> PrefixMatch:
        """Longest cached full-block prefix; splits a node so the handle ends exactly there."""
        # NOTE: an unknown salt gets a throwaway root, so probing never grows the tree.
        root = self._roots.get(salt) or _Node(salt, None, -1)
        path, _ = self._walk(root, self._full_blocks(token_ids), split=True)
        self._touch(path)
        blocks = [b for node in path for b in node.blocks]
        return PrefixMatch(blocks, len(blocks) * self.block_size, path[-1] if path else root)

    def match_len(self, token_ids: Sequence[int], salt: str = "") -> int:
        """Tokens of the cached prefix; touches neither the tree shape nor LRU times."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        return self._walk(root, self._full_blocks(token_ids), split=False)[1] * self.block_size

    def insert(
        self, token_ids: Sequence[int], blocks: Sequence[int], salt: str = ""
    ) -> InsertResult:
        """Cache the full blocks of ``token_ids`` held in ``blocks``; see the module docstring."""
        toks = self._full_blocks(token_ids)
        n_full = len(toks) // self.block_size
        if len(blocks) < n_full:
            raise ValueError(f"{len(token_ids)} tokens need {n_full} blocks, got {len(blocks)}")
        blocks = list(blocks[:n_full])
        root = self._roots.get(salt) or _Node(salt, None, next(self._ids))
        path, _ = self._walk(root, toks, split=True)
        canonical = [b for node in path for b in node.blocks]
        dups = [b for b, c in zip(blocks, canonical) if b != c]
        new = blocks[len(canonical) :]
        for b in dups + new:
            if b in self._cached_ids or self.pool.is_free(b):
                raise ValueError(f"block {b} is already cached elsewhere or is free")
        if len(set(dups + new)) != len(dups) + len(new):
            raise ValueError("the same block id appears twice in blocks")
        self.pool.free(dups)
        parent = path[-1] if path else root
        if new:
            self._roots[salt] = root
            start = len(canonical) * self.block_size
            hashes = self._chain(parent.last_hash, toks[start:], salt)
            leaf = _Node(salt, parent, next(self._ids), toks[start:], new, hashes)
            parent.children[leaf.tokens[: self.block_size]] = leaf
            self._cached_ids.update(new)
            self._evictable += len(new)
            path.append(leaf)
            self._emit("stored", leaf, token_ids=leaf.tokens)
        self._touch(path)
        handle = path[-1] if path else root
        return InsertResult(handle, canonical + new, len(new) * self.block_size)

    def lock(self, handle: object) -> None:
        """Pin every node from ``handle`` to the root (the root itself is never evictable)."""
        for node in self._ancestors(self._check_handle(handle)):
            if node.ref == 0:
                self._evictable -= len(node.blocks)
            node.ref += 1

    def unlock(self, handle: object) -> None:
        path = list(self._ancestors(self._check_handle(handle)))
        if any(n.ref <= 0 for n in path):
            raise ValueError("unlock of a prefix that is not locked")
        for n in path:
            n.ref -= 1
            if n.ref == 0:
                self._evictable += len(n.blocks)

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` (whole nodes, LRU unlocked leaves first); returns freed."""
        heap = [(n.last_access, n.seq, n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._drop(node, "evicted")
            if parent.parent is not None and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.seq, parent))
        return freed

    def allocate(self, n: int) -> list[int]:
        """``pool.allocate(n)``, evicting first if short; ``PoolExhaustedError.free`` counts
        free plus evictable blocks. Nothing is evicted when even that is not enough."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        short = n - self.pool.num_free
        if short > 0:
            if short > self._evictable:
                raise PoolExhaustedError(requested=n, free=self.pool.num_free + self._evictable)
            self.evict(short)
        return self.pool.allocate(n)

    def reset(self) -> None:
        """Drop every unlocked node; emits one "cleared" event per dropped node with its hashes.

        Locked nodes (and so their ancestors) survive and are not mentioned, so an index
        that removes the hashes of "cleared" events stays exact.
        """
        for salt, root in list(self._roots.items()):
            for node in reversed(list(self._subtree(root))):  # children before parents
                if node is not root and node.ref == 0:
                    self._drop(node, "cleared")
            if not root.children:
                self._roots.pop(salt, None)

    def all_block_hashes(self) -> list[int]:
        """Every cached block's hash, parents before children (for re-publishing to an index)."""
        return [h for node in self._nodes() for h in node.hashes]

    def snapshot_events(self) -> list[CacheEvent]:
        """The whole cache as "stored" events, one per node, parents before children.

        Each is the event ``insert`` would emit for that node now (hashes chained from its
        parent's, salt included), so an index rebuilt from them answers as the live one
        did (an instance re-publishes them when kvstore dropped its index).
        """
        return [self._event("stored", node, node.tokens) for node in self._nodes()]

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant (see module docstring)."""
        bs, seen, evictable = self.block_size, set(), 0

        def fail(msg: str) -> None:
            raise RuntimeError(f"radix cache integrity: {msg}")

        for salt, root in self._roots.items():
            if root.salt != salt or root.parent is not None or root.blocks or root.ref != 0:
                fail(f"bad root for salt {salt!r}")
            for node in self._subtree(root):
                if node is root:
                    continue
                parent = node.parent
                if not node.alive or node.salt != salt:
                    fail(f"node {node.seq} is dead or in the wrong salt subtree")
                if parent is None or parent.children.get(node.tokens[:bs]) is not node:
                    fail(f"node {node.seq} is not its parent's child under its first block")
                if not node.blocks or len(node.tokens) != len(node.blocks) * bs:
                    fail(f"node {node.seq}: {len(node.tokens)} tokens, {len(node.blocks)} blocks")
                if node.ref < 0 or (parent.parent is not None and parent.ref < node.ref):
                    fail(f"node {node.seq}: ref {node.ref} exceeds parent's {parent.ref}")
                if node.hashes != self._chain(parent.last_hash, node.tokens, salt):
                    fail(f"node {node.seq}: block hashes do not chain from its parent's")
                for b in node.blocks:
                    if b in seen:
                        fail(f"block {b} appears twice in the tree")
                    if self.pool.is_free(b):
                        fail(f"block {b} is in the tree and free in the pool")
                    seen.add(b)
                evictable += len(node.blocks) if node.ref == 0 else 0
        if seen != self._cached_ids:
            fail(f"cached set has {len(self._cached_ids)} blocks, walk found {len(seen)}")
        if evictable != self._evictable:
            fail(f"evictable counter {self._evictable} != walk {evictable}")

    def _full_blocks(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(token_ids[: len(token_ids) // self.block_size * self.block_size])

    def _chain(self, parent_hash: int, toks: tuple[int, ...], salt: str) -> list[int]:
        """Chained hashes of the full blocks of ``toks``, continuing from ``parent_hash``."""
        bs, hashes = self.block_size, []
        for start in range(0, len(toks) - bs + 1, bs):
            parent_hash = block_hash(parent_hash, toks[start : start + bs], salt)
            hashes.append(parent_hash)
        return hashes

    def _common_blocks(self, node: _Node, toks: tuple[int, ...], start: int) -> int:
        """Leading full blocks of ``node`` equal to ``toks[start:]`` (the first is known equal)."""
        bs, k = self.block_size, 1
        while k < len(node.blocks) and start + (k + 1) * bs <= len(toks):
            if node.tokens[k * bs : (k + 1) * bs] != toks[start + k * bs : start + (k + 1) * bs]:
                break
            k += 1
        return k

    def _walk(self, root: _Node, toks: tuple[int, ...], split: bool) -> tuple[list[_Node], int]:
        """Nodes on the longest cached prefix of ``toks`` and its length in blocks. With
        ``split`` the last node is cut at the match end, so the path covers exactly the prefix."""
        bs, path, node, n = self.block_size, [], root, 0
        while (child := node.children.get(toks[n * bs : (n + 1) * bs])) is not None:
            k = self._common_blocks(child, toks, n * bs)
            n += k
            if k < len(child.blocks):
                if not split:
                    break
                child = self._split(child, k)
            path.append(child)
            node = child
        return path, n

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after ``k`` blocks; returns the new upper node (same ref and time)."""
        bs, parent = self.block_size, node.parent
        top = _Node(
            node.salt,
            parent,
            next(self._ids),
            node.tokens[: k * bs],
            node.blocks[:k],
            node.hashes[:k],
            ref=node.ref,
            last_access=node.last_access,
        )
        parent.children[top.tokens[:bs]] = top
        node.tokens, node.blocks = node.tokens[k * bs :], node.blocks[k:]
        node.hashes, node.parent = node.hashes[k:], top
        top.children[node.tokens[:bs]] = node
        return top

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock

    def _drop(self, node: _Node, kind: str) -> int:
        """Detach an unlocked leaf, free its blocks and report them; returns blocks freed."""
        # NOTE: callers only drop unlocked leaves, so counters and ref-invariants stay exact.
        del node.parent.children[node.tokens[: self.block_size]]
        self.pool.free(node.blocks)
        self._cached_ids.difference_update(node.blocks)
        self._evictable -= len(node.blocks)
        node.alive = False
        if node.parent.parent is None and not node.parent.children:
            self._roots.pop(node.salt, None)  # an emptied salt subtree goes too
        self._emit(kind, node)
        return len(node.blocks)

    def _emit(self, kind: str, node: _Node, token_ids: tuple[int, ...] = ()) -> None:
        if self._on_event is not None:
            self._on_event(self._event(kind, node, token_ids))

    def _event(self, kind: str, node: _Node, token_ids: tuple[int, ...] = ()) -> CacheEvent:
        return CacheEvent(
            kind, tuple(node.hashes), node.parent.last_hash, node.salt, self.block_size, token_ids
        )

    def _check_handle(self, handle: object) -> _Node:
        if not isinstance(handle, _Node) or not handle.alive:
            raise ValueError("stale radix cache handle (its node was evicted) or not a handle")
        return handle

    @staticmethod
    def _ancestors(node: _Node) -> Iterator[_Node]:
        while node.parent is not None:
            yield node
            node = node.parent

    @staticmethod
    def _subtree(root: _Node) -> Iterator[_Node]:
        """``root`` and all below it, parents before children."""
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def _nodes(self) -> Iterator[_Node]:
        """Every non-root node, parents before children."""
        for root in list(self._roots.values()):
            yield from (n for n in self._subtree(root) if n is not root)
