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
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdd.core import block_hash_native
from pdd.core.errors import FailedPreconditionError

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
    chain = chain_hash_bytes(tokens, block_size, salt)
    return [int.from_bytes(chain[i : i + 8], "little") for i in range(0, len(chain), 8)]


def chain_hash_bytes(tokens: Sequence[int], block_size: int, salt: str = "") -> bytes:
    """``chain_hashes`` as one bytes string: each hash as 8 little-endian bytes, in order.

    The same values as ``block_hash`` chained, computed in one C loop where a compiler is at hand
    (``block_hash_native``), else with ``hashlib`` over one packed buffer — what the prefix
    index feeds Redis (a 64K-token prompt is 4,096 hashes per prediction).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    nblocks = len(tokens) // block_size
    if nblocks == 0:
        return b""
    whole = nblocks * block_size
    if isinstance(tokens, array) and tokens.typecode == "I":
        # NOTE: kvstore's requests arrive as array("I") (``pdd.wire.kvstore``): no int objects,
        # no copy but the slice; a list of 64K ints costs ~0.5 ms to pack.
        packed = tokens if len(tokens) == whole else tokens[:whole]
    else:
        packed = array("I", tokens if len(tokens) == whole else tokens[:whole])
    if packed.itemsize != 4:  # pragma: no cover — every supported platform has a 4-byte "I"
        return b"".join(
            h.to_bytes(8, "little") for h in chain_hashes_reference(tokens, block_size, salt)
        )
    salt_bytes = salt.encode("utf-8")
    lib = block_hash_native.load()
    if lib is not None:
        return block_hash_native.chain_bytes(lib, packed.tobytes(), block_size, salt_bytes, 0)
    return _chain_hashlib(packed.tobytes(), block_size, salt_bytes)


def _chain_hashlib(buf: bytes, block_size: int, salt: bytes) -> bytes:
    # NOTE: the digest of the previous block *is* its LE64 parent encoding (see block_hash).
    head = struct.pack("<I", len(salt)) + salt
    step = 4 * block_size
    blake2b = hashlib.blake2b
    digest = ROOT_HASH.to_bytes(8, "little")
    out = []
    for off in range(0, len(buf) - step + 1, step):
        digest = blake2b(digest + head + buf[off : off + step], digest_size=8).digest()
        out.append(digest)
    return b"".join(out)


def chain_hashes_reference(tokens: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The definition, block by block (tests hold the fast paths to it)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PromptChains:
    """A prompt as the prefix index searches it: its length in tokens and its chained hashes
    (``chain_hash_bytes``, salted) at some block sizes — hashed where the prompt is, so kvstore
    gets 8 bytes a block instead of 64 (block 16) and hashes nothing.

    ``len()`` is the prompt's length in tokens, as for the token ids it stands for.
    """

    tokens: int
    chains: Mapping[int, bytes]  # block size → its chain

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {self.tokens}")
        for block_size, chain in self.chains.items():
            if block_size <= 0 or len(chain) != 8 * (self.tokens // block_size):
                raise ValueError(
                    f"chains[{block_size}]: {len(chain)} bytes, expected 8 per full block of a "
                    f"{self.tokens}-token prompt"
                )

    @classmethod
    def of(cls, tokens: Sequence[int], block_sizes: Iterable[int], salt: str = "") -> PromptChains:
        packed = (
            tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
        )
        chains = {bs: chain_hash_bytes(packed, bs, salt) for bs in sorted(set(block_sizes))}
        return cls(len(packed), chains)

    def __len__(self) -> int:
        return self.tokens


def prompt_chain(prompt: Sequence[int] | PromptChains, block_size: int, salt: str = "") -> bytes:
    """``prompt``'s chain at ``block_size``: hashed from its tokens, or as its chains give it
    (none there: ``FailedPreconditionError``, the caller must send the tokens)."""
    if not isinstance(prompt, PromptChains):
        return chain_hash_bytes(prompt, block_size, salt)
    chain = prompt.chains.get(block_size)
    if chain is None:
        raise FailedPreconditionError(
            f"prompt_chains: none for block size {block_size} (an instance has it); send the "
            "prompt's token ids"
        )
    return chain
