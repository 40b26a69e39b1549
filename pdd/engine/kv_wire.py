"""The canonical KV wire format: a descriptor plus raw little-endian bytes, token-major.

Layout ``"layer,kv,token,head,dim"``: for every layer, K then V, each
``[num_tokens, num_kv_heads, head_dim]`` contiguous. Token-major (not
block-major) so a receiver with another block size just writes tokens at its own
slots; the descriptor carries the dtype so a receiver with another KV dtype
converts (float32 ↔ bfloat16 ↔ float16) on import. ``block_size`` is the
sender's, for information only.

Framing of ``to_bytes``: ``b"PDDKV1"``, a little-endian u32 header length, the
descriptor as UTF-8 JSON, then the data.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import asdict, dataclass

import torch

from pdd.engine.model_config import dtype_name, parse_dtype

WIRE_LAYOUT = "layer,kv,token,head,dim"
_MAGIC = b"PDDKV1"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KvDescriptor:
    dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    start_token: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")
        if self.layout != WIRE_LAYOUT:
            raise ValueError(f"layout must be {WIRE_LAYOUT!r}, got {self.layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.start_token < 0 or self.num_tokens < 0:
            raise ValueError(
                f"start_token and num_tokens must be >= 0, got {self.start_token}, {self.num_tokens}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class KvPayload:
    descriptor: KvDescriptor
    data: bytes  # contiguous, little-endian, ``descriptor.shape`` in ``descriptor.dtype``

    def __post_init__(self) -> None:
        if len(self.data) != self.descriptor.nbytes:
            raise ValueError(
                f"KV payload has {len(self.data)} bytes, descriptor says {self.descriptor.nbytes}"
            )

    @property
    def start_token(self) -> int:
        return self.descriptor.start_token

    @property
    def num_tokens(self) -> int:
        return self.descriptor.num_tokens

    @classmethod
    def from_tensor(
        cls,
        kv: torch.Tensor,
        start_token: int,
        block_size: int,
        dtype: str | torch.dtype | None = None,
    ) -> KvPayload:
        """``kv [L, 2, n, KV, D]`` → payload, converted to ``dtype`` (default: ``kv``'s)."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(
                f"expected a [layer, 2, token, head, dim] tensor, got shape {tuple(kv.shape)}"
            )
        kv = kv.to("cpu", parse_dtype(dtype) if dtype is not None else kv.dtype).contiguous()
        layers, _, n, heads, dim = kv.shape
        desc = KvDescriptor(
            dtype_name(kv.dtype), WIRE_LAYOUT, layers, heads, dim, block_size, start_token, n
        )
        return cls(desc, _le_bytes(kv))

    def to_tensor(self, dtype: str | torch.dtype | None = None) -> torch.Tensor:
        """The payload as ``[L, 2, n, KV, D]`` in ``dtype`` (default: the wire dtype)."""
        d = self.descriptor
        if not self.data:
            return torch.empty(d.shape, dtype=parse_dtype(dtype or d.dtype))
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)  # a writable copy
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            raise NotImplementedError("KV wire import on big-endian hosts")
        t = raw.view(parse_dtype(d.dtype)).view(d.shape)
        return t if dtype is None else t.to(parse_dtype(dtype))


def _le_bytes(t: torch.Tensor) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("KV wire export on big-endian hosts")
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def to_bytes(payload: KvPayload) -> bytes:
    header = json.dumps(asdict(payload.descriptor), sort_keys=True).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + payload.data


def from_bytes(blob: bytes) -> KvPayload:
    if blob[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a PDD KV payload (bad magic)")
    (size,) = struct.unpack_from("<I", blob, len(_MAGIC))
    start = len(_MAGIC) + 4
    try:
        desc = KvDescriptor(**json.loads(blob[start : start + size]))
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"bad KV payload header: {e}") from e
    return KvPayload(desc, bytes(blob[start + size :]))
