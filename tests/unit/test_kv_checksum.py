"""The CRC helpers compute exactly zlib's CRC-32, on the accelerated and the threaded path."""

from __future__ import annotations

import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.kv import checksum


@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
@settings(max_examples=150, deadline=None)
def test_combine_equals_the_crc_of_the_concatenation(a, b):
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@given(data=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=100, deadline=None)
def test_crc32_matches_zlib_including_a_running_value(data, seed):
    assert checksum.crc32(data, seed) == zlib.crc32(data, seed)


@pytest.mark.parametrize("accelerated", [True, False])
async def test_large_buffers_and_chunked_regions_match_zlib(monkeypatch, accelerated):
    if accelerated and not checksum.ACCELERATED:
        pytest.skip("isal is not installed")
    monkeypatch.setattr(checksum, "ACCELERATED", accelerated)
    monkeypatch.setattr(
        checksum, "_PARALLEL_MIN", 1 << 16
    )  # force the threaded split on the fallback
    data = memoryview(os.urandom((3 << 20) + 12345))
    assert checksum.crc32(data) == zlib.crc32(data)
    assert await checksum.crc32_async(data) == zlib.crc32(data)
    chunked = checksum.ChunkedCrc()
    for i in range(0, data.nbytes, 1 << 20):
        chunked.add(data[i : i + (1 << 20)])
    assert await chunked.value() == zlib.crc32(data)
