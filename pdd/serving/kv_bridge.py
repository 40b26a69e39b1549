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
from pdd.kv.compression import copy_cast, decode_tensor
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
    """KV of tokens ``[start, end)`` token-major ``[n, L, 2, KV, D]`` (call on the engine thread).

    A view of the engine's export, not a copy: our engine gathers token-major, so it is
    contiguous; another engine's layer-major export is reordered by ``write_wire``'s one copy.
    """
    return engine.export_kv(request_id, start, end).tensor.permute(2, 0, 1, 3, 4)


def write_wire(kv: torch.Tensor, layout: KvLayout, out: memoryview) -> None:
    """Token-major KV ``[n, L, 2, KV, D]`` into ``out`` (its payload bytes) in the layout's wire
    dtype: one copy that casts and reorders on the way, straight into a transfer buffer."""
    dst = (
        torch.frombuffer(out, dtype=torch.uint8)
        if out.nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    dst = dst.view(layout.dtype.torch_dtype).view(kv.shape)
    copy_cast(dst, kv)


def wire_bytes(kv: torch.Tensor, layout: KvLayout) -> memoryview:
    """Token-major KV ``[n, L, 2, KV, D]`` as a payload of its own in the layout's wire dtype."""
    out = memoryview(bytearray(layout.nbytes(kv.shape[0])))
    write_wire(kv, layout, out)
    return out


def import_range(engine: EngineBackend, request_id: str, header: TransferHeader, payload) -> None:
    """Write a received range into the request's KV, converting dtype (call on the engine thread).

    ``payload`` is read in place (a fast-link region, a reassembled buffer): the engine scatters
    from the token-major view straight into its pool.
    """
    if header.num_tokens == 0:
        return
    kv = decode_tensor(payload, header.layout, header.num_tokens, dtype=engine.dtype)
    axes = header.layout.axes.split(",")
    kv = kv.permute(*(axes.index(a) for a in _ENGINE_AXES))  # → [L, 2, n, KV, D], a view
    engine.import_kv(request_id, KvPayload.from_tensor(kv, header.start_token, engine.block_size))
