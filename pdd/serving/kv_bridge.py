"""Where the engine's KV meets the links: engine ranges ↔ transfer headers + bytes.

The engine speaks ``[layer, kv, token, head, dim]`` tensors; both links carry
KV *token-major* (``token,layer,kv,head,dim``) so that the first k tokens of
a range are the first bytes of its payload — prefill can start a push while
later chunks of the prompt are still being computed, and the receiver's
reassembly needs nothing special. The wire dtype may be a cast (fp32 → bf16,
...), chosen per link. One conversion each way, here, so prefill (sender) and
relay/main_decode (receivers) agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdd.engine.kv_wire import KvPayload
from pdd.engine.protocol import EngineBackend
from pdd.kv.compression import decode_tensor, encode_tensor
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import DEFAULT_CHUNK_BYTES, Compression, TransferHeader, make_header

TOKEN_MAJOR = "token,layer,kv,head,dim"
_ENGINE_AXES = ("layer", "kv", "token", "head", "dim")


def engine_layout(engine: EngineBackend, wire_dtype: KvDtype | None = None) -> KvLayout:
    mc = engine.model_config
    dtype = wire_dtype or KvDtype.of(engine.dtype)
    return KvLayout(
        dtype,
        mc.num_layers,
        mc.num_kv_heads,
        mc.head_dim,
        axes=TOKEN_MAJOR,
        block_size=engine.block_size,
    )


def range_header(
    engine: EngineBackend,
    request_id: str,
    start: int,
    end: int,
    token_ids: Sequence[int],
    salt: str,
    *,
    wire_dtype: KvDtype | None = None,
    compression: Compression = Compression.NONE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> TransferHeader:
    """The header of tokens ``[start, end)`` of a request, before any of it is exported."""
    return make_header(
        request_id,
        engine_layout(engine, wire_dtype),
        start,
        end - start,
        chunk_bytes=chunk_bytes,
        compression=compression,
        token_ids=tuple(token_ids),
        cache_salt=salt,
    )


def export_tokens(engine: EngineBackend, request_id: str, start: int, end: int) -> torch.Tensor:
    """KV of tokens ``[start, end)``, token-major ``[n, L, 2, KV, D]`` (call on the engine thread)."""
    kv = engine.export_kv(request_id, start, end).to_tensor()  # [L, 2, n, KV, D]
    return kv.permute(2, 0, 1, 3, 4).contiguous()  # [n, L, 2, KV, D]


def wire_bytes(kv: torch.Tensor, layout: KvLayout) -> memoryview:
    """Token-major KV ``[n, L, 2, KV, D]`` as payload bytes in the layout's wire dtype."""
    return encode_tensor(kv, layout.dtype)


def import_range(engine: EngineBackend, request_id: str, header: TransferHeader, payload) -> None:
    """Write a received range into the request's KV, converting dtype (call on the engine thread)."""
    if header.num_tokens == 0:
        return
    kv = decode_tensor(payload, header.layout, header.num_tokens, dtype=engine.dtype)
    axes = header.layout.axes.split(",")
    kv = kv.permute(*(axes.index(a) for a in _ENGINE_AXES))  # → [L, 2, n, KV, D]
    engine.import_kv(request_id, KvPayload.from_tensor(kv, header.start_token, engine.block_size))
