"""``MainDecodeService/PushKv`` requests on the wire without protobuf objects for the KV bytes.

A chunk of KV (a MiB by default) sent as ``PushKvRequest(chunk=KvChunk(...))`` through
protobuf's Python API is copied five times before the socket: out of the source buffer
(``bytes``), into the ``KvChunk``, serialized and parsed back when that message is set on the
request (upb merges a submessage by value), serialized once more, and into gRPC's slice. The
receiver copies it twice more: into the parsed message, and out again on ``.data``. Measured
(perf, 16 pushes of 2.6 MB at once, two processes): those copies were a third of the sender's
CPU and a tenth of the receiver's.

``encode_push_item`` writes a chunk's request in protobuf's own encoding (fields in number
order, default values left out: the bytes upb writes), the payload joined once onto its few
bytes of framing; a header or a commit (one each per push) goes through protobuf as before.
``PushKvDecoder.decode`` reads a chunk request of that shape in place — the chunk's ``data`` a
memoryview of the received message — and hands anything else (a header, a commit, a field
twice, an unknown field, a varint out of its field's range) to protobuf's parser, so every
valid encoding of the message is still read the same way.

NOTE: the gRPC method is the proto's; only the serializer differs. Clients and servers that use
the generated code (another language, an older PDD) interoperate unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence

import grpc

from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.kv import messages as convert
from pdd.kv.transfer import Chunk, PushItem

PUSH_KV_METHOD = "/pdd.main_decode.v1.MainDecodeService/PushKv"

# Wire tags: (field number << 3) | wire type (0 varint, 2 length-delimited).
_REQUEST_CHUNK = 0x12  # PushKvRequest.chunk = 2
_REQUEST_ID, _INDEX, _OFFSET, _DATA, _CRC = 0x0A, 0x10, 0x18, 0x22, 0x28  # KvChunk fields 1-5
_TAG = {tag: bytes([tag]) for tag in (_REQUEST_CHUNK, _REQUEST_ID, _INDEX, _OFFSET, _DATA, _CRC)}
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_MAX_VARINT_BYTES = 10


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk_request(chunk: Chunk) -> bytes:
    """``PushKvRequest(chunk=chunk)`` serialized: the payload copied once."""
    rid = chunk.request_id.encode()
    head = [_TAG[_REQUEST_ID], _varint(len(rid)), rid] if rid else []
    if chunk.index:
        head += [_TAG[_INDEX], _varint(chunk.index)]
    if chunk.offset:
        head += [_TAG[_OFFSET], _varint(chunk.offset)]
    size = len(chunk.data)
    if size:
        head += [_TAG[_DATA], _varint(size)]
    tail = _TAG[_CRC] + _varint(chunk.crc32) if chunk.crc32 else b""
    framing = b"".join(head)
    body = len(framing) + size + len(tail)
    return b"".join((_TAG[_REQUEST_CHUNK], _varint(body), framing, chunk.data, tail))


def encode_push_item(item: PushItem) -> bytes:
    """One ``PushKvRequest`` of a push (header, chunk or commit), serialized."""
    if isinstance(item, Chunk):
        return encode_chunk_request(item)
    return convert.push_request_to_pb(item).SerializeToString()


class _Fallback(Exception):
    """The message is not a chunk request in the canonical shape: protobuf parses it."""


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(at, min(at + _MAX_VARINT_BYTES, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise _Fallback


def _read_chunk(data: bytes) -> Chunk:
    if not data or data[0] != _REQUEST_CHUNK:
        raise _Fallback
    size, at = _read_varint(data, 1)
    if at + size != len(data):
        raise _Fallback
    view = memoryview(data)
    spans: dict[int, memoryview] = {}  # request_id, data: views of the message
    numbers: dict[int, int] = {}  # index, offset, crc32
    while at < len(data):
        tag = data[at]
        if tag in spans or tag in numbers:
            raise _Fallback
        if tag in (_REQUEST_ID, _DATA):
            n, at = _read_varint(data, at + 1)
            if at + n > len(data):
                raise _Fallback
            spans[tag] = view[at : at + n]
            at += n
        elif tag in (_INDEX, _OFFSET, _CRC):
            value, at = _read_varint(data, at + 1)
            if value > (_U64 if tag == _OFFSET else _U32):
                raise _Fallback
            numbers[tag] = value
        else:
            raise _Fallback
    try:
        request_id = str(spans[_REQUEST_ID], "utf-8") if _REQUEST_ID in spans else ""
    except UnicodeDecodeError:
        raise _Fallback from None  # NOTE: protobuf's parser names the error
    return Chunk(
        request_id,
        numbers.get(_INDEX, 0),
        numbers.get(_OFFSET, 0),
        spans.get(_DATA, view[0:0]),
        numbers.get(_CRC, 0),
    )


class PushKvDecoder:
    """The server's request deserializer for ``PushKv``: a chunk request → ``Chunk`` (its data a
    view of the message), anything else → the parsed ``PushKvRequest``
    (``push_items_from_wire`` converts those, where a bad one is the servicer's error).

    NOTE: a class, not a function: ``pdd.server.handlers`` names an undecodable request by
    its deserializer's owner's ``DESCRIPTOR``."""

    DESCRIPTOR = mdpb.PushKvRequest.DESCRIPTOR

    def decode(self, data: bytes) -> Chunk | mdpb.PushKvRequest:
        try:
            return _read_chunk(data)
        except _Fallback:
            return mdpb.PushKvRequest.FromString(data)


async def push_items_from_wire(
    requests: AsyncIterable[Chunk | mdpb.PushKvRequest],
) -> AsyncIterator[PushItem]:
    """A ``PushKv`` servicer's request stream (``PushKvDecoder``'s output) as domain items."""
    async for msg in requests:
        yield msg if isinstance(msg, Chunk) else convert.push_item_from_pb(msg)


def push_kv_handler(behavior) -> grpc.RpcMethodHandler:
    """``PushKv``'s method handler with ``PushKvDecoder`` reading its requests."""
    return grpc.stream_unary_rpc_method_handler(
        behavior,
        request_deserializer=PushKvDecoder().decode,
        response_serializer=mdpb.PushKvResponse.SerializeToString,
    )


def push_kv_call(channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] | None = None):
    """A ``PushKv`` call on ``channel`` taking a stream of ``PushItem`` (``encode_push_item``):
    ``call(items)`` → awaitable ``PushKvResponse``."""
    method = channel.stream_unary(
        PUSH_KV_METHOD,
        request_serializer=encode_push_item,
        response_deserializer=mdpb.PushKvResponse.FromString,
    )

    def call(items: AsyncIterator[PushItem]):
        return method(items, metadata=metadata)

    return call
