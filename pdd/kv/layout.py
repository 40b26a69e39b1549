"""How KV bytes are laid out on the wire: element type and axis order.

A ``KvLayout`` describes one token range of one request's KV well enough for a
receiver with another block size or dtype to convert it (``pdd.engine.kv_wire``
uses the same axis names). ``dtype`` is the element type *on the wire*: a sender
that casts float32 KV to bfloat16 for the WAN says bfloat16 here, and the
receiver casts to its own pool dtype on import (``pdd.kv.compression``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

WIRE_AXES = "layer,kv,token,head,dim"
_KNOWN_AXES = frozenset({"layer", "kv", "token", "head", "dim"})
_REQUIRED_AXES = frozenset({"layer", "token", "head", "dim"})


class KvDtype(enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3 = "float8_e4m3"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH[self]

    @classmethod
    def of(cls, dtype: torch.dtype | str | KvDtype) -> KvDtype:
        """The wire dtype for a torch dtype or a name (``"bf16"``, ``"float32"``, ...)."""
        if isinstance(dtype, KvDtype):
            return dtype
        if isinstance(dtype, torch.dtype):
            for k, v in _TORCH.items():
                if v == dtype:
                    return k
            raise ValueError(f"dtype: {dtype} has no KV wire dtype")
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"dtype: unknown KV dtype {dtype!r}") from None


_ITEMSIZE = {KvDtype.FLOAT32: 4, KvDtype.FLOAT16: 2, KvDtype.BFLOAT16: 2, KvDtype.FLOAT8_E4M3: 1}
_TORCH = {
    KvDtype.FLOAT32: torch.float32,
    KvDtype.FLOAT16: torch.float16,
    KvDtype.BFLOAT16: torch.bfloat16,
    KvDtype.FLOAT8_E4M3: torch.float8_e4m3fn,
}
_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3",
    "fp8_e4m3": "float8_e4m3",
    "float8_e4m3fn": "float8_e4m3",
}


@dataclass(frozen=True)
class KvLayout:
    dtype: KvDtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    axes: str = WIRE_AXES
    # The sender's block size: informational, the wire is token-addressed.
    block_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, KvDtype):
            raise ValueError(f"dtype: expected a KvDtype, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.block_size < 0:
            raise ValueError(f"block_size: must be >= 0, got {self.block_size}")
        names = self.axes.split(",")
        if (
            len(set(names)) != len(names)
            or not set(names) <= _KNOWN_AXES
            or not _REQUIRED_AXES <= set(names)
        ):
            raise ValueError(
                f"axes: expected a permutation of {WIRE_AXES!r} (kv optional), got {self.axes!r}"
            )

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """Tensor shape of ``num_tokens`` tokens, in ``axes`` order."""
        sizes = {
            "layer": self.num_layers,
            "kv": 2,
            "token": num_tokens,
            "head": self.num_kv_heads,
            "dim": self.head_dim,
        }
        return tuple(sizes[a] for a in self.axes.split(","))

    @property
    def bytes_per_token(self) -> int:
        n = self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return n * 2 if "kv" in self.axes.split(",") else n

    def nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    def with_dtype(self, dtype: KvDtype) -> KvLayout:
        return KvLayout(
            dtype, self.num_layers, self.num_kv_heads, self.head_dim, self.axes, self.block_size
        )
