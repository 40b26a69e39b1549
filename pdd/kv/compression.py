"""Optional KV compression on the wire: a dtype cast, then zlib per chunk.

Two independent steps, applied by the sender and undone by the receiver:

- **dtype cast** (whole payload, before chunking): float32 KV goes as
  bfloat16, float16 or float8 e4m3 (``torch.float8_e4m3fn``). The header's
  ``layout.dtype`` names the wire dtype; ``decode_tensor`` returns the KV in
  that dtype or casts it to the dtype the receiver's pool uses. Lossy:
  bf16 keeps 8 mantissa bits, fp8 e4m3 3 bits and a range of ±448.
- **zlib** (per chunk, ``Compression.ZLIB``): ``compress_chunk`` /
  ``decompress_chunk``. The chunk CRC covers the compressed bytes; offsets and
  ``total_bytes`` are in decompressed bytes. Random-looking float mantissas
  compress little: zlib pays off mostly for fp8 and for sparse/zero KV.

NOTE: ``decompress_chunk`` never inflates past the length the header fixes for
the chunk, so a hostile chunk cannot blow up the receiver's memory.
"""

from __future__ import annotations

import sys
import zlib

import torch

from pdd.core.errors import InvalidArgumentError
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import Compression

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def cast_for_wire(kv: torch.Tensor, wire: KvDtype) -> torch.Tensor:
    """``kv`` as a contiguous CPU tensor of the wire dtype (fp8 saturates at ±448, no NaN)."""
    kv = kv.detach().to("cpu")
    if wire is KvDtype.FLOAT8_E4M3:
        # NOTE: out-of-range values would become NaN in e4m3fn; saturate instead.
        kv = kv.float().clamp_(-_FP8_MAX, _FP8_MAX)
    return kv.to(wire.torch_dtype).contiguous()


def copy_cast(dst: torch.Tensor, kv: torch.Tensor) -> None:
    """``dst.copy_(kv)`` to ``dst``'s wire dtype in one pass (fp8 saturating, as ``cast_for_wire``)."""
    if dst.dtype == torch.float8_e4m3fn:
        kv = kv.float().clamp(-_FP8_MAX, _FP8_MAX)  # NOTE: out of range would become NaN
    dst.copy_(kv)


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("KV wire format on big-endian hosts")
    if kv.device.type != "cpu" or not kv.is_contiguous():
        raise InvalidArgumentError("kv", "must be a contiguous CPU tensor")
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy()).cast("B")


def encode_tensor(kv: torch.Tensor, wire: KvDtype) -> memoryview:
    """Cast ``kv`` to ``wire`` and return its payload bytes."""
    return tensor_bytes(cast_for_wire(kv, wire))


def decode_tensor(
    payload: bytes | bytearray | memoryview,
    layout: KvLayout,
    num_tokens: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The payload as a tensor of ``layout.shape(num_tokens)``, in ``dtype`` (default: the wire dtype).

    Zero-copy over a writable buffer (a ``Reassembler``'s payload, a shared-memory
    region) when no cast is asked for.
    """
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.nbytes(num_tokens):
        raise InvalidArgumentError(
            "payload", f"has {view.nbytes} bytes, layout says {layout.nbytes(num_tokens)}"
        )
    if view.nbytes == 0:
        raw = torch.empty(0, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    t = raw.view(layout.dtype.torch_dtype).view(layout.shape(num_tokens))
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def compress_chunk(
    data: bytes | memoryview, compression: Compression, level: int = 1
) -> bytes | memoryview:
    """A chunk's bytes as sent. NOTE: uncompressed, ``data`` itself (no copy): a view of the
    sender's payload buffer, which keeps the bytes unchanged for resends."""
    if compression is Compression.NONE:
        return data
    if compression is Compression.ZLIB:
        return zlib.compress(data, level)
    raise InvalidArgumentError("compression", f"unsupported {compression!r}")


def decompress_chunk(
    data: bytes | memoryview, compression: Compression, expected_len: int
) -> bytes | memoryview:
    """Undo ``compress_chunk``; the result must be exactly ``expected_len`` bytes."""
    if compression is Compression.NONE:
        out = data
    elif compression is Compression.ZLIB:
        inflater = zlib.decompressobj()
        try:
            out = inflater.decompress(data, expected_len + 1)
        except zlib.error as e:
            raise InvalidArgumentError("chunk.data", f"not a zlib stream: {e}") from None
        if not inflater.eof:
            raise InvalidArgumentError(
                "chunk.data", f"inflates past its span of {expected_len} bytes or is truncated"
            )
    else:
        raise InvalidArgumentError("compression", f"unsupported {compression!r}")
    if len(out) != expected_len:
        raise InvalidArgumentError(
            "chunk.data", f"holds {len(out)} bytes, its span is {expected_len}"
        )
    return out
