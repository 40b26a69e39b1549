"""``push_codec``: PushKv's chunk requests written and read by hand, exactly as protobuf would."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from pdd.gen.common.v1 import common_pb2 as cpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as mdgrpc
from pdd.kv import messages as convert
from pdd.kv import push_codec
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import Chunk, Commit, make_header
from pdd.server.handlers import _Undecodable, register_overriding

chunks = st.builds(
    Chunk,
    st.text(max_size=40),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=3000),
    st.integers(0, 2**32 - 1),
)


@given(chunks)
def test_a_chunk_is_encoded_as_protobuf_encodes_it_and_read_back_in_place(chunk):
    wire = push_codec.encode_push_item(chunk)
    assert wire == convert.push_request_to_pb(chunk).SerializeToString()
    back = push_codec.PushKvDecoder().decode(wire)
    assert back == chunk
    assert isinstance(back, Chunk) and isinstance(back.data, memoryview)
    assert back.data.obj is wire  # NOTE: a view of the message, not a copy


def test_a_chunk_whose_data_is_a_view_of_the_senders_buffer_is_encoded_the_same():
    buffer = bytearray(b"\x01\x02\x03\x04\x05")
    view = Chunk("r", 1, 2, memoryview(buffer)[1:4], 7)
    assert push_codec.encode_push_item(view) == push_codec.encode_push_item(
        Chunk("r", 1, 2, b"\x02\x03\x04", 7)
    )


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def _varint_field(number: int, value: int) -> bytes:
    return bytes([number << 3]) + push_codec._varint(value)


@pytest.mark.parametrize(
    "body",
    [
        # crc before data: another field order
        _field(1, b"r") + _varint_field(5, 9) + _field(4, b"kv"),
        # index twice: the last wins
        _field(1, b"r") + _varint_field(2, 1) + _varint_field(2, 3) + _field(4, b"kv"),
        # an unknown field (a newer sender) is skipped
        _field(1, b"r") + _field(4, b"kv") + _varint_field(9, 1),
        # index past uint32: protobuf keeps its low 32 bits
        _field(1, b"r") + _varint_field(2, 2**32 + 5) + _field(4, b"kv"),
    ],
)
def test_any_other_encoding_of_a_chunk_is_read_as_protobuf_reads_it(body):
    wire = _field(2, body)
    got = push_codec.PushKvDecoder().decode(wire)
    expected = convert.push_item_from_pb(mdpb.PushKvRequest.FromString(wire))
    item = got if isinstance(got, Chunk) else convert.push_item_from_pb(got)
    assert item == expected


def test_headers_and_commits_go_through_protobuf_and_reach_the_servicer_as_items():
    header = make_header("r", KvLayout(KvDtype.FLOAT32, 2, 2, 8), 0, 4)
    commit = Commit("r", (5, 6))
    decoder = push_codec.PushKvDecoder()
    wires = [push_codec.encode_push_item(x) for x in (header, commit)]
    assert [type(decoder.decode(w)) for w in wires] == [mdpb.PushKvRequest] * 2

    async def read():
        async def stream():
            for w in wires:
                yield decoder.decode(w)

        return [x async for x in push_codec.push_items_from_wire(stream())]

    assert asyncio.run(read()) == [header, commit]


@pytest.mark.parametrize(
    "wire",
    [
        b"\x12\x05ab",  # truncated
        _field(2, _field(1, b"\xff\xfe")),  # request_id not UTF-8
        b"\x12\x80",  # a varint cut short
    ],
)
def test_a_broken_message_is_protobufs_decode_error_naming_the_message(wire):
    decoder = push_codec.PushKvDecoder()
    with pytest.raises(DecodeError) as caught:
        decoder.decode(wire)
    # the server's handler turns it into INVALID_ARGUMENT naming the message
    assert _Undecodable(decoder.decode, caught.value).name == "pdd.main_decode.v1.PushKvRequest"


async def test_overriding_a_method_nobody_has_is_refused():
    class Servicer(mdgrpc.MainDecodeServiceServicer):
        pass

    server = grpc.aio.server()
    with pytest.raises(ValueError, match="overrides: .* has no method PushKV"):
        register_overriding(
            mdgrpc.add_MainDecodeServiceServicer_to_server,
            Servicer(),
            server,
            {"PushKV": push_codec.push_kv_handler(Servicer().PushKv)},
        )


def test_the_generated_parser_reads_what_the_codec_writes():
    chunk = Chunk("req", 2, 4096, b"\x00" * 100, 123)
    msg = mdpb.PushKvRequest.FromString(push_codec.encode_push_item(chunk))
    assert msg.chunk == cpb.KvChunk(
        request_id="req", index=2, offset=4096, data=b"\x00" * 100, crc32=123
    )
