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


@dataclass(frozen=True, eq=False)
class KvPayload:
    """A KV range in the canonical format, held as a tensor so that no step copies it needlessly.

    ``tensor`` is ``descriptor.shape`` in ``descriptor.dtype`` on the CPU, of any strides: an
    exporter may gather token-major and hand out the ``[L, 2, n, KV, D]`` view of it, an importer
    may wrap a received buffer in place (``from_buffer``). ``data`` materialises the canonical
    bytes, copying only when the tensor is not laid out canonically already.

    NOTE: a payload shares memory with what it was made from, and ``to_tensor`` with the payload.
    """

    descriptor: KvDescriptor
    tensor: torch.Tensor  # [L, 2, n, KV, D]

    def __post_init__(self) -> None:
        d, t = self.descriptor, self.tensor
        if tuple(t.shape) != d.shape or t.dtype != parse_dtype(d.dtype):
            raise ValueError(
                f"KV payload tensor is {tuple(t.shape)} {dtype_name(t.dtype)}, "
                f"descriptor says {d.shape} {d.dtype}"
            )
        if t.device.type != "cpu":
            raise ValueError(f"KV payload tensor must be on the CPU, got {t.device}")

    @property
    def start_token(self) -> int:
        return self.descriptor.start_token

    @property
    def num_tokens(self) -> int:
        return self.descriptor.num_tokens

    @property
    def data(self) -> memoryview:
        """The canonical little-endian bytes (a copy only where ``tensor`` is not contiguous)."""
        return _le_bytes(self.tensor.contiguous())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvPayload):
            return NotImplemented
        return self.descriptor == other.descriptor and torch.equal(self.tensor, other.tensor)

    __hash__ = None  # type: ignore[assignment]  # a tensor's contents are not hashable

    @classmethod
    def from_tensor(
        cls,
        kv: torch.Tensor,
        start_token: int,
        block_size: int,
        dtype: str | torch.dtype | None = None,
    ) -> KvPayload:
        """``kv [L, 2, n, KV, D]`` → payload in ``dtype`` (default: ``kv``'s); no copy when ``kv``
        is already a CPU tensor of that dtype (whatever its strides)."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(
                f"expected a [layer, 2, token, head, dim] tensor, got shape {tuple(kv.shape)}"
            )
        kv = kv.to("cpu", parse_dtype(dtype) if dtype is not None else kv.dtype)
        layers, _, n, heads, dim = kv.shape
        desc = KvDescriptor(
            dtype_name(kv.dtype), WIRE_LAYOUT, layers, heads, dim, block_size, start_token, n
        )
        return cls(desc, kv)

    @classmethod
    def from_buffer(
        cls, descriptor: KvDescriptor, data: bytes | bytearray | memoryview
    ) -> KvPayload:
        """A payload over canonical bytes: in place when ``data`` is writable, else one copy."""
        view = memoryview(data).cast("B")
        if view.nbytes != descriptor.nbytes:
            raise ValueError(
                f"KV payload has {view.nbytes} bytes, descriptor says {descriptor.nbytes}"
            )
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            raise NotImplementedError("KV wire import on big-endian hosts")
        dtype = parse_dtype(descriptor.dtype)
        if view.nbytes == 0:
            return cls(descriptor, torch.empty(descriptor.shape, dtype=dtype))
        raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        return cls(descriptor, raw.view(dtype).view(descriptor.shape))

    def to_tensor(self, dtype: str | torch.dtype | None = None) -> torch.Tensor:
        """The payload as ``[L, 2, n, KV, D]``: without ``dtype`` the payload's own tensor (no
        copy: for an importer that writes it into its pool at once), with one a tensor of its
        own in that dtype (for one that keeps it past the call: the payload's memory may be a
        region the relay reuses once the import returns)."""
        return self.tensor if dtype is None else self.tensor.to(parse_dtype(dtype), copy=True)


def _le_bytes(t: torch.Tensor) -> memoryview:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("KV wire export on big-endian hosts")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


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
    return KvPayload.from_buffer(desc, memoryview(blob)[start + size :])
