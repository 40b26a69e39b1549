"""The chained block hash of ``pdd.core.block_hash`` in C, for long prompts (kvstore's predictions).

A 64K-token prompt at block size 16 is 4,096 chained BLAKE2b-64 digests: ~5 ms even with
``hashlib`` over one bytes buffer (a Python call per block), ~0.55 ms in one C loop (a shared
2-core Xeon; ~130 ns a block, near what scalar BLAKE2b allows: the chain is sequential). The C is
compiled once with the system's C compiler into a per-user cache folder (``PDD_NATIVE_CACHE``,
else ``~/.cache/pdd``) and loaded with ctypes; where there is no compiler (or no cache folder),
``load()`` returns None and ``block_hash`` keeps its ``hashlib`` path.

NOTE: this is the same function, not a second hash: BLAKE2b (RFC 7693) with an 8-byte digest,
no key, over exactly the bytes ``block_hash.block_hash`` feeds ``hashlib.blake2b`` (parent LE64,
salt length LE32, salt, tokens LE32 each). tests/unit/test_block_hash_native.py holds the two
to equal answers on random prompts, salts and block sizes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const uint64_t IV[8] = {
  0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
  0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t SIGMA[12][16] = {
  {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
  {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
  {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
  {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
  {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
  {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
  {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
  {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
  {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
  {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
  {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
  {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y) \
  a = a + b + (x); d = ROTR(d ^ a, 32); c = c + d; b = ROTR(b ^ c, 24); \
  a = a + b + (y); d = ROTR(d ^ a, 16); c = c + d; b = ROTR(b ^ c, 63);

/* NOTE: a little-endian host only (load() checks): a plain copy is the LE64 load. */
static uint64_t load64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

static void compress(uint64_t h[8], const uint8_t *blk, uint64_t t, int last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; i++) m[i] = load64(blk + 8 * i);
  for (int i = 0; i < 8; i++) { v[i] = h[i]; v[i + 8] = IV[i]; }
  v[12] ^= t;
  if (last) v[14] = ~v[14];
  /* NOTE: unrolled, so every SIGMA index is a constant and m[] stays in registers (~20% off
     the per-block cost against a loop over r). */
#define ROUND(r) \
  G(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]); \
  G(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]); \
  G(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]); \
  G(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]); \
  G(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]); \
  G(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]); \
  G(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]); \
  G(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);
  ROUND(0) ROUND(1) ROUND(2) ROUND(3) ROUND(4) ROUND(5)
  ROUND(6) ROUND(7) ROUND(8) ROUND(9) ROUND(10) ROUND(11)
#undef ROUND
  for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

static uint64_t blake2b64(const uint8_t *msg, size_t len) {
  uint64_t h[8];
  uint8_t blk[128];
  size_t off = 0;
  memcpy(h, IV, sizeof h);
  h[0] ^= 0x01010000ULL ^ 8;  /* depth 1, fanout 1, no key, 8-byte digest */
  while (len - off > 128) { compress(h, msg + off, off + 128, 0); off += 128; }
  memset(blk, 0, sizeof blk);
  memcpy(blk, msg + off, len - off);
  compress(h, blk, len, 1);
  return h[0];
}

/* tokens: nblocks * bs little-endian uint32; out: nblocks little-endian uint64. */
int pdd_chain_hashes(const uint8_t *tokens, size_t nblocks, size_t bs, const uint8_t *salt,
                     uint32_t saltlen, uint64_t parent, uint8_t *out) {
  size_t head = 12 + saltlen, len = head + 4 * bs;
  uint8_t *buf = malloc(len);
  if (!buf) return -1;
  for (int i = 0; i < 4; i++) buf[8 + i] = (uint8_t)(saltlen >> (8 * i));
  memcpy(buf + 12, salt, saltlen);
  for (size_t b = 0; b < nblocks; b++) {
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(parent >> (8 * i));
    memcpy(buf + head, tokens + 4 * bs * b, 4 * bs);
    parent = blake2b64(buf, len);
    for (int i = 0; i < 8; i++) out[8 * b + i] = (uint8_t)(parent >> (8 * i));
  }
  free(buf);
  return 0;
}
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []


def _cache_dir() -> Path:
    return Path(os.environ.get("PDD_NATIVE_CACHE") or Path.home() / ".cache" / "pdd")


def _build(target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, so = Path(tmp) / "chain.c", Path(tmp) / "chain.so"
        src.write_text(_SOURCE)
        subprocess.run(
            [compiler, "-O3", "-shared", "-fPIC", "-o", str(so), str(src)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(so, target)  # NOTE: atomic, so concurrent builders never load a partial file


def load() -> ctypes.CDLL | None:
    """The compiled chain function (built on first use), or None where it cannot be had."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        lib = None
        if sys.byteorder == "little" and not os.environ.get("PDD_NO_NATIVE_HASH"):
            digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
            target = _cache_dir() / f"block_hash-{digest}.so"
            try:
                if not target.exists():
                    _build(target)
                lib = ctypes.CDLL(str(target))
                lib.pdd_chain_hashes.restype = ctypes.c_int
                lib.pdd_chain_hashes.argtypes = [
                    ctypes.c_char_p,
                    ctypes.c_size_t,
                    ctypes.c_size_t,
                    ctypes.c_char_p,
                    ctypes.c_uint32,
                    ctypes.c_uint64,
                    ctypes.c_char_p,
                ]
            except (OSError, subprocess.SubprocessError):
                lib = None
        _loaded.append(lib)
        return lib


def chain_bytes(
    lib: ctypes.CDLL, tokens: bytes, block_size: int, salt: bytes, parent: int
) -> bytes:
    """``tokens`` (LE uint32, whole blocks) → the concatenated LE 8-byte chained hashes."""
    nblocks = len(tokens) // (4 * block_size)
    out = ctypes.create_string_buffer(8 * nblocks)
    if lib.pdd_chain_hashes(tokens, nblocks, block_size, salt, len(salt), parent, out) != 0:
        raise MemoryError("pdd_chain_hashes: out of memory")
    return out.raw
