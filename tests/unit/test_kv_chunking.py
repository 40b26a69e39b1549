"""Chunk geometry, checksums and reassembly in any order, with duplicates and corruption."""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from pdd.kv.chunking import ChunkVerdict, Reassembler, encode_chunk, split
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import Compression, TransferHeader, chunk_span, make_header

LAYOUT = KvLayout(KvDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=8)  # 256 bytes per token


def _header(
    num_tokens: int, chunk_bytes: int, compression: Compression = Compression.NONE
) -> TransferHeader:
    return make_header(
        "r1", LAYOUT, 0, num_tokens, chunk_bytes=chunk_bytes, compression=compression
    )


@given(num_tokens=st.integers(0, 300), chunk_bytes=st.integers(1, 70_000))
@settings(max_examples=200, deadline=None)
def test_chunk_spans_tile_the_payload_and_respect_the_bound(num_tokens, chunk_bytes):
    h = _header(num_tokens, chunk_bytes)
    spans = [chunk_span(h, i) for i in range(h.num_chunks)]
    end = 0
    for offset, length in spans:
        assert offset == end and 0 < length <= chunk_bytes
        end += length
    assert end == h.total_bytes == num_tokens * 256


def test_header_rejects_inconsistent_sizes_naming_the_field():
    h = _header(10, 1000)
    with pytest.raises(ValueError, match="^total_bytes"):
        replace(h, total_bytes=h.total_bytes + 1)
    with pytest.raises(ValueError, match="^num_chunks"):
        replace(h, num_chunks=0)
    # 9 bytes in 4 balanced chunks of 3 would leave the last one empty.
    tiny = KvLayout(KvDtype.FLOAT8_E4M3, 1, 1, 9, axes="layer,token,head,dim")
    with pytest.raises(ValueError, match="^num_chunks"):
        TransferHeader("r", tiny, 0, 1, 9, 4)


@pytest.mark.parametrize("compression", list(Compression))
def test_shuffled_chunks_with_duplicates_reassemble_to_the_payload(compression):
    payload = os.urandom(100 * 256)
    h = _header(100, 3000, compression)
    chunks = list(split(h, payload))
    assert len(chunks) == h.num_chunks == 9
    order = chunks + chunks[:4]
    random.Random(7).shuffle(order)
    r = Reassembler(h)
    verdicts = [r.accept(c) for c in order]
    assert (
        verdicts.count(ChunkVerdict.ACCEPTED) == 9 and verdicts.count(ChunkVerdict.DUPLICATE) == 4
    )
    assert r.complete and r.missing() == []
    assert bytes(r.take()) == payload
    with pytest.raises(FailedPreconditionError, match="already taken"):
        r.take()


def test_zlib_shrinks_compressible_payload_on_the_wire():
    payload = bytes(50 * 256)  # zero KV
    h = _header(50, 4096, Compression.ZLIB)
    chunks = list(split(h, payload))
    assert sum(len(c.data) for c in chunks) < len(payload) // 20
    r = Reassembler(h)
    for c in chunks:
        r.accept(c)
    assert bytes(r.take()) == payload


def test_corrupt_chunk_is_reported_missing_until_resent():
    payload = os.urandom(20 * 256)
    h = _header(20, 1024)
    chunks = list(split(h, payload))
    bad = replace(chunks[2], data=bytes([chunks[2].data[0] ^ 1]) + chunks[2].data[1:])
    r = Reassembler(h)
    assert r.accept(bad) is ChunkVerdict.CORRUPT
    for c in chunks[:2] + chunks[3:]:
        r.accept(c)
    assert not r.complete and r.missing() == [2] and r.corrupt == 1
    with pytest.raises(FailedPreconditionError, match="missing"):
        r.take()
    assert r.accept(chunks[2]) is ChunkVerdict.ACCEPTED
    assert bytes(r.take()) == payload


def test_chunks_that_contradict_the_header_are_rejected():
    h = _header(8, 512)
    chunks = list(split(h, os.urandom(h.total_bytes)))
    r = Reassembler(h)
    with pytest.raises(InvalidArgumentError, match="chunk.offset"):
        r.accept(replace(chunks[1], offset=chunks[1].offset + 1))
    with pytest.raises(InvalidArgumentError, match="chunk.index"):
        r.accept(replace(chunks[0], index=h.num_chunks))
    with pytest.raises(InvalidArgumentError, match="chunk.request_id"):
        r.accept(replace(chunks[0], request_id="other"))
    short = chunks[0].data[:-1]
    with pytest.raises(InvalidArgumentError, match="chunk.data"):
        r.accept(replace(chunks[0], data=short, crc32=zlib.crc32(short)))
    assert r.missing() == list(range(h.num_chunks))


def test_zlib_bomb_cannot_inflate_past_its_span():
    h = _header(4, 256, Compression.ZLIB)
    bomb = zlib.compress(bytes(10 << 20))
    chunk = replace(encode_chunk(h, 0, bytes(256)), data=bomb, crc32=zlib.crc32(bomb))
    with pytest.raises(InvalidArgumentError, match="inflates past"):
        Reassembler(h).accept(chunk)


def test_absurd_declared_size_is_rejected_before_allocating():
    huge = make_header("r", LAYOUT, 0, 1 << 30, chunk_bytes=1 << 30)  # 256 GiB declared
    with pytest.raises(ResourceExhaustedError, match="exceeds the limit"):
        Reassembler(huge, max_total_bytes=1 << 30)
    many = make_header("r", LAYOUT, 0, 1 << 16, chunk_bytes=8)  # 2M chunks of 8 bytes
    with pytest.raises(InvalidArgumentError, match="num_chunks"):
        Reassembler(many)


def test_reassembles_in_place_into_a_caller_region():
    payload = os.urandom(6 * 256)
    h = _header(6, 500)
    region = bytearray(h.total_bytes)
    r = Reassembler(h, buffer=memoryview(region))
    for c in reversed(list(split(h, payload))):
        r.accept(c)
    assert region == payload and r.take().obj is region
    with pytest.raises(InvalidArgumentError, match="buffer"):
        Reassembler(h, buffer=memoryview(bytes(h.total_bytes)))


def test_empty_range_is_complete_at_once():
    r = Reassembler(_header(0, 1024))
    assert r.complete and bytes(r.take()) == b""
