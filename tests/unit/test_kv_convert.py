"""Round trips of the KV converters through wire bytes, and the fields their errors name."""

from __future__ import annotations

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.gen.common.v1 import common_pb2 as cpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.gen.relay.v1 import relay_service_pb2 as rpb
from pdd.kv import messages as convert
from pdd.kv.chunking import split
from pdd.kv.fast_link.region import Completion, PrepareRequest, RdmaEndpointInfo, Reservation
from pdd.kv.fast_link.state import Transport
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.transfer import Commit, Compression, TransferStatus, make_header


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", list(KvDtype))
@pytest.mark.parametrize("compression", list(Compression))
def test_header_round_trip(dtype, compression):
    layout = KvLayout(dtype, 4, 2, 64, axes="layer,kv,token,head,dim", block_size=16)
    h = make_header(
        "req-9",
        layout,
        128,
        37,
        chunk_bytes=5000,
        compression=compression,
        token_ids=(1, 2, 2**32 - 1),
        cache_salt="tenant",
    )
    assert convert.header_from_pb(_wire(convert.header_to_pb(h))) == h


def test_push_items_round_trip():
    layout = KvLayout(KvDtype.BFLOAT16, 1, 1, 8)
    h = make_header("r", layout, 0, 10, chunk_bytes=64)
    chunk = next(split(h, bytes(range(256)) + bytes(64)))
    for item in (h, chunk, Commit("r", (7, 8))):
        assert convert.push_item_from_pb(_wire(convert.push_request_to_pb(item))) == item


def test_status_round_trips():
    s = TransferStatus("r", True, 9, (3, 5), False, 1000, 7)
    back = convert.push_response_from_pb(_wire(convert.push_response_to_pb(s)))
    assert (back.missing, back.complete, back.bytes_received, back.chunks_received) == (
        (3, 5),
        False,
        1000,
        7,
    )
    got = convert.transfer_status_from_pb("r", _wire(convert.transfer_status_to_pb(s)))
    assert (got.known, got.num_chunks, got.missing, got.complete) == (True, 9, (3, 5), False)


def test_fast_link_messages_round_trip():
    layout = KvLayout(KvDtype.FLOAT16, 2, 4, 32)
    prep = PrepareRequest(
        "r", layout, 11, layout.nbytes(11), (Transport.RDMA, Transport.SHM, Transport.TCP)
    )
    assert convert.prepare_request_from_pb(_wire(convert.prepare_request_to_pb(prep))) == prep
    rdma = RdmaEndpointInfo(2**48 + 5, 77, 1234, 3, bytes(range(16)), 99)
    for res in (
        Reservation("t1", "r", Transport.RDMA, prep.total_bytes, 5000, rdma=rdma),
        Reservation("t2", "r", Transport.SHM, prep.total_bytes, 5000, shm_name="pdd-t2"),
        Reservation("t3", "r", Transport.TCP, prep.total_bytes, 5000),
    ):
        assert convert.reservation_from_pb(_wire(convert.reservation_to_pb(res)), prep) == res
    done = Completion("t1", make_header("r", layout, 0, 11), 0xDEADBEEF, (42,))
    assert convert.completion_from_pb(_wire(convert.completion_to_pb(done))) == done
    h = make_header("r", layout, 0, 11)
    assert convert.relay_push_item_from_pb(_wire(convert.relay_push_request_to_pb("t3", h))) == (
        "t3",
        h,
    )


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m.ClearField("layout"), "header.layout"),
        (lambda m: setattr(m.layout, "dtype", cpb.KV_DTYPE_UNSPECIFIED), "header.layout.dtype"),
        (lambda m: setattr(m.layout, "num_layers", 0), "header.layout.num_layers"),
        (lambda m: setattr(m.layout, "axes", "token,layer"), "header.layout.axes"),
        (lambda m: setattr(m, "total_bytes", m.total_bytes + 1), "header.total_bytes"),
        (lambda m: setattr(m, "num_chunks", 0), "header.num_chunks"),
        (lambda m: setattr(m, "request_id", ""), "header.request_id"),
        (lambda m: setattr(m, "compression", 99), "header.compression"),
    ],
)
def test_bad_header_names_its_field(mutate, field):
    msg = convert.header_to_pb(make_header("r", KvLayout(KvDtype.FLOAT32, 2, 2, 8), 0, 10))
    mutate(msg)
    with pytest.raises(InvalidArgumentError) as e:
        convert.header_from_pb(msg)
    assert e.value.field == field


def test_unset_compression_means_none_and_empty_items_are_rejected():
    msg = convert.header_to_pb(make_header("r", KvLayout(KvDtype.FLOAT32, 1, 1, 4), 0, 2))
    msg.compression = cpb.KV_COMPRESSION_UNSPECIFIED
    assert convert.header_from_pb(msg).compression is Compression.NONE
    with pytest.raises(InvalidArgumentError, match="item"):
        convert.push_item_from_pb(mdpb.PushKvRequest())
    with pytest.raises(InvalidArgumentError, match="shm_name"):
        convert.reservation_from_pb(
            rpb.PrepareTransferResponse(transfer_id="t", transport=rpb.FAST_LINK_TRANSPORT_SHM),
            PrepareRequest("r", KvLayout(KvDtype.FLOAT32, 1, 1, 4), 1, 32),
        )
