"""Where the engine's KV meets the links: engine ranges ↔ transfer headers + bytes.

The engine speaks ``KvPayload`` (its canonical token-major wire format); the
links speak ``TransferHeader`` + raw bytes in the header's wire dtype (which
may be a cast, e.g. fp32 → bf16, chosen per link). One conversion each way,
here, so prefill (sender) and relay/main_decode (receivers) agree by
construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.engine.engine import Engine
from pdd.engine.kv_wire import KvPayload
from pdd.kv.compression import decode_tensor, encode_tensor
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import DEFAULT_CHUNK_BYTES, Compression, TransferHeader, make_header


def engine_layout(engine: Engine, wire_dtype: KvDtype | None = None) -> KvLayout:
    mc = engine.model_config
    dtype = wire_dtype or KvDtype.of(engine.dtype)
    return KvLayout(dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size=engine.block_size)


def export_range(engine: Engine, request_id: str, start: int, end: int, token_ids: Sequence[int], salt: str, *,
                 wire_dtype: KvDtype | None = None, compression: Compression = Compression.NONE,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[TransferHeader, memoryview]:
    """KV of tokens ``[start, end)`` as a transfer header and its bytes (call on the engine thread)."""
    layout = engine_layout(engine, wire_dtype)
    header = make_header(request_id, layout, start, end - start, chunk_bytes=chunk_bytes, compression=compression,
                         token_ids=tuple(token_ids), cache_salt=salt)
    if end == start:
        return header, memoryview(b"")
    kv = engine.export_kv(request_id, start, end).to_tensor()  # [L, 2, n, KV, D]
    return header, encode_tensor(kv, layout.dtype)


def import_range(engine: Engine, request_id: str, header: TransferHeader, payload) -> None:
    """Write a received range into the request's KV, converting dtype (call on the engine thread)."""
    if header.num_tokens == 0:
        return
    kv = decode_tensor(payload, header.layout, header.num_tokens, dtype=engine.dtype)  # [L, 2, n, KV, D]
    engine.import_kv(request_id, KvPayload.from_tensor(kv, header.start_token, engine.block_size))
