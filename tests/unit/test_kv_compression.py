"""Wire dtype casts: exact round trips where lossless, bounded error where not."""

from __future__ import annotations

import pytest
import torch

from pdd.core.errors import InvalidArgumentError
from pdd.kv.compression import cast_for_wire, decode_tensor, encode_tensor
from pdd.kv.layout import KvDtype, KvLayout

LAYOUT = KvLayout(KvDtype.FLOAT32, num_layers=3, num_kv_heads=2, head_dim=16)


def _kv(num_tokens: int = 5, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYOUT.shape(num_tokens), generator=g) * scale  # [L, 2, T, H, D]


def test_float32_round_trip_is_exact_and_zero_copy():
    kv = _kv()
    payload = bytearray(encode_tensor(kv, KvDtype.FLOAT32))
    back = decode_tensor(payload, LAYOUT, 5)
    assert torch.equal(back, kv)
    back[0, 0, 0, 0, 0] = 42.0  # a view over the receiver's buffer, not a copy
    assert decode_tensor(payload, LAYOUT, 5)[0, 0, 0, 0, 0] == 42.0


@pytest.mark.parametrize(
    ("wire", "rel_tol"),
    [(KvDtype.BFLOAT16, 2**-8), (KvDtype.FLOAT16, 2**-11), (KvDtype.FLOAT8_E4M3, 2**-4)],
)
def test_cast_on_the_wire_halves_or_quarters_bytes_within_its_precision(wire, rel_tol):
    kv = _kv()
    payload = encode_tensor(kv, wire)
    assert payload.nbytes == kv.numel() * wire.itemsize
    back = decode_tensor(payload, LAYOUT.with_dtype(wire), 5, dtype=torch.float32)
    assert back.dtype == torch.float32 and back.shape == kv.shape
    # Relative error bounded by half an ulp of the wire format (normal range).
    mask = kv.abs() > 0.05
    rel = ((back - kv).abs() / kv.abs())[mask]
    assert rel.max().item() <= rel_tol


def test_fp8_saturates_instead_of_producing_nan():
    kv = _kv(scale=1000.0)
    back = cast_for_wire(kv, KvDtype.FLOAT8_E4M3).float()
    assert not torch.isnan(back).any()
    assert back.abs().max().item() == 448.0


def test_decode_rejects_a_payload_of_the_wrong_size():
    with pytest.raises(InvalidArgumentError, match="payload"):
        decode_tensor(bytes(10), LAYOUT, 5)


def test_dtype_names_and_torch_dtypes_resolve():
    assert KvDtype.of("bf16") is KvDtype.BFLOAT16
    assert KvDtype.of(torch.float8_e4m3fn) is KvDtype.FLOAT8_E4M3
    with pytest.raises(ValueError, match="^dtype"):
        KvDtype.of("int4")
