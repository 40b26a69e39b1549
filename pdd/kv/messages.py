"""The one place KV transfer records meet their proto messages.

``*_to_pb`` builds a message from a domain record; ``*_from_pb`` validates a
message and returns the record, raising ``InvalidArgumentError`` that names the
offending field (``header.layout.dtype``, ``chunk.index``, ...). Servicers and
clients of ``MainDecodeService/PushKv``, ``GetKvTransfer`` and the relay's fast
link build nothing by hand.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

from pdd.core.errors import InvalidArgumentError
from pdd.gen.common.v1 import common_pb2 as cpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.gen.relay.v1 import relay_service_pb2 as rpb
from pdd.kv.fast_link.region import Completion, PrepareRequest, RdmaEndpointInfo, Reservation
from pdd.kv.fast_link.state import Transport
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import Chunk, Commit, Compression, PushItem, TransferHeader, TransferStatus

T = TypeVar("T")

_DTYPE = {
    KvDtype.FLOAT32: cpb.KV_DTYPE_FLOAT32,
    KvDtype.FLOAT16: cpb.KV_DTYPE_FLOAT16,
    KvDtype.BFLOAT16: cpb.KV_DTYPE_BFLOAT16,
    KvDtype.FLOAT8_E4M3: cpb.KV_DTYPE_FLOAT8_E4M3,
}
_DTYPE_BACK = {v: k for k, v in _DTYPE.items()}
_COMPRESSION = {
    Compression.NONE: cpb.KV_COMPRESSION_NONE,
    Compression.ZLIB: cpb.KV_COMPRESSION_ZLIB,
}
_COMPRESSION_BACK = {v: k for k, v in _COMPRESSION.items()} | {
    cpb.KV_COMPRESSION_UNSPECIFIED: Compression.NONE
}
_TRANSPORT = {
    Transport.RDMA: rpb.FAST_LINK_TRANSPORT_RDMA,
    Transport.SHM: rpb.FAST_LINK_TRANSPORT_SHM,
    Transport.TCP: rpb.FAST_LINK_TRANSPORT_TCP,
}
_TRANSPORT_BACK = {v: k for k, v in _TRANSPORT.items()}


def _build(field: str, make: Callable[[], T]) -> T:
    """Run a validating constructor; its ``ValueError("name: why")`` becomes ``field.name``."""
    try:
        return make()
    except InvalidArgumentError:
        raise
    except ValueError as e:
        name, sep, why = str(e).partition(": ")
        raise InvalidArgumentError(
            f"{field}.{name}" if sep else field, why if sep else str(e)
        ) from None


def _lookup(table: dict, value: int, field: str) -> T:
    try:
        return table[value]
    except KeyError:
        raise InvalidArgumentError(field, f"unsupported value {value}") from None


def layout_to_pb(layout: KvLayout) -> cpb.KvLayout:
    return cpb.KvLayout(
        dtype=_DTYPE[layout.dtype],
        axes=layout.axes,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
    )


def layout_from_pb(msg: cpb.KvLayout, field: str = "layout") -> KvLayout:
    dtype = _lookup(_DTYPE_BACK, msg.dtype, f"{field}.dtype")
    return _build(
        field,
        lambda: KvLayout(
            dtype, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.axes, msg.block_size
        ),
    )


def header_to_pb(h: TransferHeader) -> cpb.KvTransferHeader:
    return cpb.KvTransferHeader(
        request_id=h.request_id,
        layout=layout_to_pb(h.layout),
        start_token=h.start_token,
        num_tokens=h.num_tokens,
        num_chunks=h.num_chunks,
        total_bytes=h.total_bytes,
        compression=_COMPRESSION[h.compression],
        token_ids=h.token_ids,
        cache_salt=h.cache_salt,
    )


def header_from_pb(msg: cpb.KvTransferHeader, field: str = "header") -> TransferHeader:
    if not msg.HasField("layout"):
        raise InvalidArgumentError(f"{field}.layout", "is required")
    layout = layout_from_pb(msg.layout, f"{field}.layout")
    compression = _lookup(_COMPRESSION_BACK, msg.compression, f"{field}.compression")
    return _build(
        field,
        lambda: TransferHeader(
            msg.request_id,
            layout,
            msg.start_token,
            msg.num_tokens,
            msg.total_bytes,
            msg.num_chunks,
            compression,
            tuple(msg.token_ids),
            msg.cache_salt,
        ),
    )


def chunk_to_pb(c: Chunk) -> cpb.KvChunk:
    return cpb.KvChunk(
        request_id=c.request_id,
        index=c.index,
        offset=c.offset,
        data=c.data if isinstance(c.data, bytes) else bytes(c.data),  # NOTE: upb takes bytes only
        crc32=c.crc32,
    )


def chunk_from_pb(msg: cpb.KvChunk) -> Chunk:
    return Chunk(msg.request_id, msg.index, msg.offset, msg.data, msg.crc32)


def commit_to_pb(c: Commit) -> mdpb.KvTransferCommit:
    return mdpb.KvTransferCommit(request_id=c.request_id, output_token_ids=c.output_token_ids)


def commit_from_pb(msg: mdpb.KvTransferCommit) -> Commit:
    return Commit(msg.request_id, tuple(msg.output_token_ids))


# -- MainDecodeService: PushKv / GetKvTransfer -------------------------------------------------


def push_request_to_pb(item: PushItem) -> mdpb.PushKvRequest:
    if isinstance(item, TransferHeader):
        return mdpb.PushKvRequest(header=header_to_pb(item))
    if isinstance(item, Chunk):
        return mdpb.PushKvRequest(chunk=chunk_to_pb(item))
    return mdpb.PushKvRequest(commit=commit_to_pb(item))


def push_item_from_pb(msg: mdpb.PushKvRequest) -> PushItem:
    kind = msg.WhichOneof("item")
    if kind == "header":
        return header_from_pb(msg.header)
    if kind == "chunk":
        return chunk_from_pb(msg.chunk)
    if kind == "commit":
        return commit_from_pb(msg.commit)
    raise InvalidArgumentError("item", "one of header, chunk, commit is required")


async def push_items_from_pb(
    requests: AsyncIterable[mdpb.PushKvRequest],
) -> AsyncIterator[PushItem]:
    """A servicer's ``request_iterator`` as domain items, for ``KvReceiver.receive``."""
    async for msg in requests:
        yield push_item_from_pb(msg)


def push_response_to_pb(s: TransferStatus) -> mdpb.PushKvResponse:
    return mdpb.PushKvResponse(
        request_id=s.request_id,
        bytes_received=s.bytes_received,
        chunks_received=s.chunks_received,
        missing_chunk_indices=s.missing,
        complete=s.complete,
    )


def push_response_from_pb(msg: mdpb.PushKvResponse) -> TransferStatus:
    return TransferStatus(
        msg.request_id,
        True,
        0,
        tuple(msg.missing_chunk_indices),
        msg.complete,
        msg.bytes_received,
        msg.chunks_received,
    )


def transfer_status_to_pb(s: TransferStatus) -> mdpb.GetKvTransferResponse:
    return mdpb.GetKvTransferResponse(
        known=s.known, num_chunks=s.num_chunks, missing_chunk_indices=s.missing, complete=s.complete
    )


def transfer_status_from_pb(request_id: str, msg: mdpb.GetKvTransferResponse) -> TransferStatus:
    return TransferStatus(
        request_id, msg.known, msg.num_chunks, tuple(msg.missing_chunk_indices), msg.complete
    )


# -- RelayService: the fast link ---------------------------------------------------------------


def transport_from_pb(value: int, field: str = "transport") -> Transport:
    return _lookup(_TRANSPORT_BACK, value, field)


def prepare_request_to_pb(r: PrepareRequest) -> rpb.PrepareTransferRequest:
    return rpb.PrepareTransferRequest(
        request_id=r.request_id,
        layout=layout_to_pb(r.layout),
        num_tokens=r.num_tokens,
        total_bytes=r.total_bytes,
        transports=[_TRANSPORT[t] for t in r.transports],
    )


def prepare_request_from_pb(msg: rpb.PrepareTransferRequest) -> PrepareRequest:
    layout = layout_from_pb(msg.layout)
    transports = tuple(transport_from_pb(t, "transports") for t in msg.transports)
    return _build(
        "request",
        lambda: PrepareRequest(msg.request_id, layout, msg.num_tokens, msg.total_bytes, transports),
    )


def rdma_endpoint_to_pb(e: RdmaEndpointInfo) -> rpb.RdmaEndpoint:
    return rpb.RdmaEndpoint(
        remote_addr=e.remote_addr, rkey=e.rkey, qp_num=e.qp_num, lid=e.lid, gid=e.gid, psn=e.psn
    )


def rdma_endpoint_from_pb(msg: rpb.RdmaEndpoint) -> RdmaEndpointInfo:
    return RdmaEndpointInfo(msg.remote_addr, msg.rkey, msg.qp_num, msg.lid, msg.gid, msg.psn)


def reservation_to_pb(r: Reservation) -> rpb.PrepareTransferResponse:
    msg = rpb.PrepareTransferResponse(
        transport=_TRANSPORT[r.transport], transfer_id=r.transfer_id, lease_ms=r.lease_ms
    )
    if r.rdma is not None:
        msg.rdma.CopyFrom(rdma_endpoint_to_pb(r.rdma))
    elif r.shm_name:
        msg.shm_name = r.shm_name
    return msg


def reservation_from_pb(msg: rpb.PrepareTransferResponse, request: PrepareRequest) -> Reservation:
    """The reservation answering ``request`` (the response does not repeat its id and size)."""
    if not msg.transfer_id:
        raise InvalidArgumentError("transfer_id", "must not be empty")
    transport = transport_from_pb(msg.transport)
    rdma = rdma_endpoint_from_pb(msg.rdma) if msg.WhichOneof("endpoint") == "rdma" else None
    if transport is Transport.RDMA and rdma is None:
        raise InvalidArgumentError("rdma", "is required for the RDMA transport")
    if transport is Transport.SHM and not msg.shm_name:
        raise InvalidArgumentError("shm_name", "is required for the shared-memory transport")
    return Reservation(
        msg.transfer_id,
        request.request_id,
        transport,
        request.total_bytes,
        msg.lease_ms,
        msg.shm_name,
        rdma,
    )


def completion_to_pb(c: Completion) -> rpb.CompleteTransferRequest:
    return rpb.CompleteTransferRequest(
        transfer_id=c.transfer_id,
        request_id=c.header.request_id,
        header=header_to_pb(c.header),
        output_token_ids=c.output_token_ids,
        crc32=c.crc32,
    )


def completion_from_pb(msg: rpb.CompleteTransferRequest) -> Completion:
    if not msg.transfer_id:
        raise InvalidArgumentError("transfer_id", "must not be empty")
    header = header_from_pb(msg.header)
    if msg.request_id and msg.request_id != header.request_id:
        raise InvalidArgumentError(
            "request_id", f"{msg.request_id!r} differs from header.request_id"
        )
    return Completion(msg.transfer_id, header, msg.crc32, tuple(msg.output_token_ids))


def relay_push_request_to_pb(transfer_id: str, item: TransferHeader | Chunk) -> rpb.PushKvRequest:
    if isinstance(item, TransferHeader):
        return rpb.PushKvRequest(header=header_to_pb(item), transfer_id=transfer_id)
    return rpb.PushKvRequest(chunk=chunk_to_pb(item), transfer_id=transfer_id)


def relay_push_item_from_pb(msg: rpb.PushKvRequest) -> tuple[str, TransferHeader | Chunk]:
    kind = msg.WhichOneof("item")
    if kind == "header":
        return msg.transfer_id, header_from_pb(msg.header)
    if kind == "chunk":
        return msg.transfer_id, chunk_from_pb(msg.chunk)
    raise InvalidArgumentError("item", "one of header, chunk is required")


async def relay_push_items_from_pb(
    requests: AsyncIterable[rpb.PushKvRequest],
) -> AsyncIterator[tuple[str, TransferHeader | Chunk]]:
    """A relay servicer's ``request_iterator`` as items for ``FastLinkReceiver.receive_chunks``."""
    async for msg in requests:
        yield relay_push_item_from_pb(msg)
