"""The KV path's copies: one gather out of the pool, one copy into a link's buffer, one scatter
into the receiver's pool — each checked against a slow per-token reference, and the views that
replace the other copies checked to really share memory."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdd.core.errors import InvalidArgumentError, UnavailableError
from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.engine.kv_cache import KvCache
from pdd.engine.kv_wire import KvDescriptor, KvPayload, from_bytes, to_bytes
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.source import FilledSource
from pdd.serving.kv_bridge import TOKEN_MAJOR, export_tokens, write_wire

L, NB, BS, H, D = 3, 8, 4, 2, 8


def _cache(dtype=torch.float32) -> KvCache:
    cache = KvCache(L, NB, BS, H, D, dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def _reference_read(cache: KvCache, slots: list[int]) -> torch.Tensor:
    """[L, 2, n, KV, D], one token and one layer at a time."""
    c = cache
    out = torch.empty(c.num_layers, 2, len(slots), c.num_kv_heads, c.head_dim, dtype=c.dtype)
    for i, slot in enumerate(slots):
        block, offset = divmod(slot, c.block_size)
        for layer in range(c.num_layers):
            out[layer, :, i] = cache.data[layer, block, offset]  # [2, KV, D]
    return out


SLOTS = [13, 2, 30, 7, 8, 21]


def test_read_tokens_is_one_token_major_gather():
    cache = _cache()
    kv = cache.read_tokens(torch.tensor(SLOTS))
    torch.testing.assert_close(kv, _reference_read(cache, SLOTS), rtol=0, atol=0)
    assert kv.permute(2, 0, 1, 3, 4).is_contiguous()  # token-major underneath: the links' layout


@pytest.mark.parametrize("token_major", [True, False])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_tokens_from_any_layout_and_dtype(token_major, src_dtype):
    src = torch.randn(len(SLOTS), L, 2, H, D).to(src_dtype)  # [n, L, 2, KV, D]
    kv = src.permute(1, 2, 0, 3, 4)  # [L, 2, n, KV, D], a token-major view
    if not token_major:
        kv = kv.contiguous()  # layer-major, as a from_bytes payload is
    cache = KvCache(L, NB, BS, H, D, torch.float32)
    cache.write_tokens(torch.tensor(SLOTS), kv)
    torch.testing.assert_close(_reference_read(cache, SLOTS), kv.float(), rtol=0, atol=0)
    untouched = sorted(set(range(NB * BS)) - set(SLOTS))
    assert _reference_read(cache, untouched).eq(0).all()


def test_payload_from_tensor_shares_memory_and_materialises_canonical_bytes():
    cache = _cache()
    kv = cache.read_tokens(torch.tensor(SLOTS))
    payload = KvPayload.from_tensor(kv, 4, BS)
    assert payload.tensor.data_ptr() == kv.data_ptr()  # no copy at export
    assert payload.to_tensor() is payload.tensor
    # Asked for a dtype, an importer gets memory of its own (it may keep it past the call).
    assert payload.to_tensor("float32").data_ptr() != kv.data_ptr()
    assert bytes(payload.data) == kv.contiguous().numpy().tobytes()
    back = from_bytes(to_bytes(payload))
    assert back == payload and back.tensor.is_contiguous()
    assert KvPayload.from_tensor(kv, 4, BS, "bfloat16").descriptor.dtype == "bfloat16"


def test_payload_from_buffer_is_in_place_over_writable_memory_and_checks_sizes():
    desc = KvDescriptor("float32", "layer,kv,token,head,dim", L, H, D, BS, 0, 2)
    buf = bytearray(desc.nbytes)
    payload = KvPayload.from_buffer(desc, memoryview(buf))
    buf[:4] = b"\x00\x00\x80\x3f"  # 1.0f written into the buffer...
    assert payload.tensor[0, 0, 0, 0, 0].item() == 1.0  # ...is the payload's
    frozen = KvPayload.from_buffer(desc, bytes(buf))  # read-only memory: one copy, writable
    assert frozen == payload and frozen.tensor.data_ptr() != payload.tensor.data_ptr()
    with pytest.raises(ValueError, match="bytes"):
        KvPayload.from_buffer(desc, buf[:-4])
    with pytest.raises(ValueError, match="descriptor says"):
        KvPayload(desc, torch.zeros(L, 2, 3, H, D))


def test_write_wire_casts_and_reorders_straight_into_the_buffer():
    kv = torch.randn(L, 2, 5, H, D).permute(2, 0, 1, 3, 4) * 1000  # [n, L, 2, KV, D], strided
    for wire, tol in ((KvDtype.FLOAT32, 0.0), (KvDtype.BFLOAT16, 8e-3)):
        layout = KvLayout(wire, L, H, D, axes=TOKEN_MAJOR)
        buf = bytearray(layout.nbytes(5))
        write_wire(kv, layout, memoryview(buf))
        got = torch.frombuffer(buf, dtype=wire.torch_dtype).view(kv.shape).float()
        torch.testing.assert_close(got, kv, rtol=tol, atol=0)
    fp8 = KvLayout(KvDtype.FLOAT8_E4M3, L, H, D, axes=TOKEN_MAJOR)
    buf = bytearray(fp8.nbytes(5))
    write_wire(kv, fp8, memoryview(buf))
    got = torch.frombuffer(buf, dtype=torch.float8_e4m3fn).float()
    assert not got.isnan().any() and got.abs().max().item() == 448.0  # saturated, never NaN


def test_engine_export_is_token_major_and_equals_the_pool():
    engine = Engine(tiny_model(3, num_layers=2), EngineConfig(num_blocks=16, block_size=4))
    prompt = list(range(1, 23))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1), keep_after_finish=True)
    while not engine.step():
        pass
    kv = export_tokens(engine, "r", 3, 19)  # [n, L, 2, KV, D]
    assert kv.shape[0] == 16 and kv.is_contiguous()
    slots = engine.blocks.slots(engine._get("r"), 3, 19)
    torch.testing.assert_close(
        kv.permute(1, 2, 0, 3, 4), _reference_read(engine.kv, slots), rtol=0, atol=0
    )


async def test_filled_source_reads_wait_for_their_span_and_see_the_producer_write():
    source = FilledSource(8)
    reader = asyncio.create_task(source.read(2, 4))
    await asyncio.sleep(0)
    source.span(3)[:] = b"abc"
    source.advance(3)
    await asyncio.sleep(0)
    assert not reader.done()  # [2, 6) is not all there yet
    source.span(5)[:] = b"defgh"
    source.advance(5)
    assert bytes(await reader) == b"cdef" and source.produced == 8
    with pytest.raises(InvalidArgumentError, match="overran"):
        source.span(1)
    with pytest.raises(InvalidArgumentError, match="outside"):
        await source.read(6, 4)


async def test_a_failed_producer_fails_waiting_and_later_reads():
    source = FilledSource(4)
    reader = asyncio.create_task(source.read(0, 4))
    await asyncio.sleep(0)
    source.fail(UnavailableError("prefill stopped"))
    with pytest.raises(UnavailableError, match="prefill stopped"):
        await reader
    with pytest.raises(UnavailableError):
        await source.read(0, 1)
