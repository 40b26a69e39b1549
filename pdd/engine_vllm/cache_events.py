"""vLLM's own KV events → PDD's cache events (chained block hashes), and the cache they imply.

vLLM names a block by its own hash; kvstore and the gateway name it by
``pdd.core.block_hash`` (parent hash, salt, tokens). ``CacheMirror`` follows vLLM's
``BlockStored`` (which carries the blocks' token ids and, on a prompt's first block, the cache
salt among its extra keys), ``BlockRemoved`` and ``AllBlocksCleared`` events, keeps
vLLM hash → PDD hash, and re-states each as a ``CacheEvent`` — so routing sees exactly the
blocks vLLM's prefix cache holds. The same mirror answers ``prefix_match_len`` (a walk of the
prompt's chained hashes) and ``snapshot``.

``MirrorPublisher`` takes the place of vLLM's event publisher on its scheduler (vLLM's config
accepts only its own publishers by name), so each step's batch reaches the mirror in order.
NOTE: assumes no LoRA and no multimodal inputs (their extra keys would precede the salt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdd.core.block_hash import ROOT_HASH, block_hash, chain_hashes
from pdd.core.cache_event import CacheEvent


@dataclass(frozen=True)
class _Block:
    pdd_hash: int
    parent: int  # PDD hash of the block before it (ROOT_HASH first)
    salt: str
    tokens: tuple[int, ...]


class CacheMirror:
    def __init__(self, block_size: int, on_event: Callable[[CacheEvent], None] | None) -> None:
        self.block_size = block_size
        self._on_event = on_event
        self._by_vllm: dict[Any, _Block] = {}
        self._held: set[int] = set()  # PDD hashes of the blocks vLLM holds

    def apply(self, events: Sequence[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._by_vllm.clear()
                self._held.clear()
                self._emit(CacheEvent("cleared", (), ROOT_HASH, "", self.block_size))

    def _stored(self, ev: Any) -> None:
        if ev.block_size != self.block_size:
            raise ValueError(
                f"vLLM stored {ev.block_size}-token blocks, expected {self.block_size}"
            )
        parent_block = (
            None if ev.parent_block_hash is None else self._by_vllm.get(ev.parent_block_hash)
        )
        if ev.parent_block_hash is not None and parent_block is None:
            return  # NOTE: its parent was never seen (or is gone): not reachable by a prefix walk
        parent = ROOT_HASH if parent_block is None else parent_block.pdd_hash
        salt = "" if parent_block is None else parent_block.salt
        extra = ev.extra_keys or [None] * len(ev.block_hashes)
        hashes, tokens = [], list(ev.token_ids)
        first_parent, first_salt = parent, salt
        for i, vllm_hash in enumerate(ev.block_hashes):
            block_tokens = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            if parent == ROOT_HASH and extra[i]:
                salt = next((k for k in reversed(extra[i]) if isinstance(k, str)), salt)
                if i == 0:
                    first_salt = salt
            h = block_hash(parent, block_tokens, salt)
            self._by_vllm[vllm_hash] = _Block(h, parent, salt, block_tokens)
            self._held.add(h)
            hashes.append(h)
            parent = h
        self._emit(
            CacheEvent(
                "stored", tuple(hashes), first_parent, first_salt, self.block_size, tuple(tokens)
            )
        )

    def _removed(self, vllm_hashes: Sequence[Any]) -> None:
        for vllm_hash in vllm_hashes:
            block = self._by_vllm.pop(vllm_hash, None)
            if block is None:
                continue
            self._held.discard(block.pdd_hash)
            self._emit(
                CacheEvent("evicted", (block.pdd_hash,), block.parent, block.salt, self.block_size)
            )

    def _emit(self, event: CacheEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    @property
    def num_blocks(self) -> int:
        return len(self._held)

    def match_len(self, token_ids: Sequence[int], salt: str = "") -> int:
        """Leading tokens of ``token_ids`` in whole blocks vLLM holds (a chained-hash walk)."""
        n = 0
        for h in chain_hashes(token_ids, self.block_size, salt):
            if h not in self._held:
                break
            n += self.block_size
        return n

    def snapshot(self) -> list[CacheEvent]:
        """Every held block as a "stored" event, each after its parent's."""
        blocks = {b.pdd_hash: b for b in self._by_vllm.values()}
        out: list[CacheEvent] = []
        done: set[int] = set()
        for block in blocks.values():
            chain = []
            while block.pdd_hash not in done:
                chain.append(block)
                done.add(block.pdd_hash)
                parent = blocks.get(block.parent)
                if parent is None:
                    break
                block = parent
            for b in reversed(chain):
                out.append(
                    CacheEvent("stored", (b.pdd_hash,), b.parent, b.salt, self.block_size, b.tokens)
                )
        return out


class MirrorPublisher:
    """Stands in for vLLM scheduler's event publisher (``publish(batch)``, ``shutdown()``): each
    step's batch goes to the mirror, on the scheduler's (the engine's) thread."""

    def __init__(self, mirror: CacheMirror) -> None:
        self._mirror = mirror

    def publish(self, batch: Any) -> None:
        self._mirror.apply(batch.events)

    def shutdown(self) -> None:
        return
