"""The fast link's shared protocol over shared memory: round trip, leases, CRC, selection.

Everything but the verbs calls of the RDMA transport is exercised here; the
``rdma``-marked test runs the real thing where a device exists.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import zlib
from dataclasses import replace

import pytest
import torch

from pdd.core.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    ResourceExhaustedError,
    UnavailableError,
)
from pdd.kv.compression import decode_tensor
from pdd.kv.fast_link.rdma import pyverbs_available, rdma_devices
from pdd.kv.fast_link.receiver import FastLinkConfig, FastLinkReceiver
from pdd.kv.fast_link.region import Completion, PrepareRequest
from pdd.kv.fast_link.select import HostProbe, probe_host, select_transport, usable_candidates
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import (
    ShmReceiverBackend,
    ShmSenderBackend,
    ShmWriter,
    segment_exists,
    segment_size,
)
from pdd.kv.fast_link.state import TransferState, Transport, advance
from pdd.kv.fast_link.tcp import TcpReceiverBackend
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.source import BytesSource, StreamedSource
from pdd.kv.transfer import make_header

LAYOUT = KvLayout(KvDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=32)  # 1 KiB per token
TOKENS = 300


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _prepare_request(rid: str = "r", transports=(Transport.SHM, Transport.TCP)) -> PrepareRequest:
    return PrepareRequest(rid, LAYOUT, TOKENS, LAYOUT.nbytes(TOKENS), tuple(transports))


def _header(rid: str = "r"):
    return make_header(rid, LAYOUT, 0, TOKENS, chunk_bytes=64 << 10)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def shm_backend():
    backend = ShmReceiverBackend()
    yield backend
    backend.close()  # unlink the segments kept for reuse


@pytest.fixture
def relay(clock, shm_backend):
    rx = FastLinkReceiver(
        [shm_backend, TcpReceiverBackend()], FastLinkConfig(lease_s=5), clock=clock
    )
    yield rx
    rx.cancel("r")  # free what a failing test left behind


async def test_shm_round_trip_hands_the_relay_a_zero_copy_view(relay):
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request())
    assert reservation.transport is Transport.SHM and segment_exists(reservation.shm_name)
    waiter = asyncio.create_task(relay.wait_complete("r", 5))
    report = await FastLinkSender([ShmSenderBackend()]).send(
        reservation, _header(), BytesSource(payload), relay.complete, [11]
    )
    assert (
        report.state is TransferState.COMPLETED
        and relay.state(reservation.transfer_id) is TransferState.COMPLETED
    )
    got = await waiter
    assert bytes(got.view) == payload and got.output_token_ids == (11,)
    kv = decode_tensor(got.view, LAYOUT, TOKENS)  # [L, 2, T, H, D] over the segment itself
    got.view[:4] = b"\x00\x00\x80\x3f"  # 1.0f written through the region...
    assert kv[0, 0, 0, 0, 0].item() == 1.0  # ...is seen by the tensor: no copy was made
    del kv
    got.view.release()
    relay.release(reservation.transfer_id)
    # A completed transfer's segment is kept for the next one (no sender writes to it any more).
    assert segment_exists(reservation.shm_name) and relay.held_regions == 0


async def test_a_completed_segment_serves_the_next_transfer_and_the_sender_keeps_its_mapping(
    relay, shm_backend
):
    sender_backend = ShmSenderBackend()
    names = []
    for i in range(3):
        payload = bytes([i + 1]) * LAYOUT.nbytes(TOKENS)
        reservation = await relay.prepare(_prepare_request())
        names.append(reservation.shm_name)
        report = await FastLinkSender([sender_backend]).send(
            reservation, _header(), BytesSource(payload), relay.complete
        )
        assert report.state is TransferState.COMPLETED
        got = await relay.wait_complete("r", 1)
        assert bytes(got.view) == payload  # the reused segment holds this transfer's bytes
        relay.release(reservation.transfer_id)
    assert names[0] == names[1] == names[2]
    assert (
        sender_backend.mapped_bytes == shm_backend.idle_bytes == segment_size(LAYOUT.nbytes(TOKENS))
    )
    shm_backend.close()  # the relay unlinks it: the sender's next open drops its mapping too
    assert not segment_exists(names[0])
    reservation = await relay.prepare(_prepare_request())
    writer = await sender_backend.open(reservation, _header())
    assert reservation.shm_name != names[0] and sender_backend.mapped_bytes == segment_size(
        reservation.total_bytes
    )
    writer.close()
    relay.cancel("r")
    assert not segment_exists(reservation.shm_name)  # a cancelled transfer's is never reused
    sender_backend.close()


async def test_without_a_pool_a_released_segment_is_unlinked(clock):
    relay = FastLinkReceiver([ShmReceiverBackend(pool_bytes=0)], clock=clock)
    reservation = await relay.prepare(_prepare_request())
    report = await FastLinkSender([ShmSenderBackend(max_mapped_bytes=0)]).send(
        reservation, _header(), BytesSource(bytes(reservation.total_bytes)), relay.complete
    )
    assert report.state is TransferState.COMPLETED
    relay.release(reservation.transfer_id)
    assert not segment_exists(reservation.shm_name)


async def test_closing_the_receiver_unlinks_held_and_idle_segments(clock):
    """A relay shutting down leaves nothing in /dev/shm: neither a segment kept for reuse nor
    one still reserved for a transfer in flight."""
    relay = FastLinkReceiver([ShmReceiverBackend()], clock=clock)
    done = await relay.prepare(_prepare_request("a"))
    report = await FastLinkSender([ShmSenderBackend(max_mapped_bytes=0)]).send(
        done, _header("a"), BytesSource(bytes(done.total_bytes)), relay.complete
    )
    assert report.state is TransferState.COMPLETED
    relay.release(done.transfer_id)  # kept for the next transfer
    pending = await relay.prepare(_prepare_request("b"))
    assert segment_exists(done.shm_name) and segment_exists(pending.shm_name)
    relay.close()
    assert not segment_exists(done.shm_name) and not segment_exists(pending.shm_name)
    assert relay.held_regions == 0


def _child_write(name: str, nbytes: int, payload: bytes) -> None:
    writer = ShmWriter(name, nbytes)
    writer.view[:] = payload
    writer.close()


async def test_a_writer_in_another_process_fills_the_segment(relay):
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request())
    child = multiprocessing.get_context("fork").Process(
        target=_child_write, args=(reservation.shm_name, len(payload), payload)
    )
    child.start()
    await asyncio.to_thread(child.join, 30)
    assert child.exitcode == 0
    state = await relay.complete(
        Completion(reservation.transfer_id, _header(), zlib.crc32(payload))
    )
    assert state is TransferState.COMPLETED
    assert bytes((await relay.wait_complete("r", 1)).view) == payload


async def test_producer_still_computing_streams_into_the_segment(relay):
    reservation = await relay.prepare(_prepare_request())
    layer_bytes = LAYOUT.nbytes(TOKENS) // 4

    async def layers():
        for i in range(4):
            await asyncio.sleep(0)
            yield bytes([i]) * layer_bytes

    source = StreamedSource(LAYOUT.nbytes(TOKENS), layers())
    report = await FastLinkSender([ShmSenderBackend()]).send(
        reservation, _header(), source, relay.complete
    )
    assert report.state is TransferState.COMPLETED
    view = (await relay.wait_complete("r", 1)).view
    assert [view[i * layer_bytes] for i in range(4)] == [0, 1, 2, 3]
    view.release()


async def test_lease_expiry_frees_the_segment_and_refuses_completion(relay, clock):
    reservation = await relay.prepare(_prepare_request())
    clock.now += 4.9
    assert relay.expire() == []
    clock.now += 0.2
    assert relay.expire() == [reservation.transfer_id]
    assert relay.state(reservation.transfer_id) is TransferState.EXPIRED
    assert not segment_exists(reservation.shm_name) and relay.reserved_bytes == 0
    with pytest.raises(UnavailableError, match="not found"):
        await FastLinkSender([ShmSenderBackend()]).send(
            reservation, _header(), BytesSource(bytes(reservation.total_bytes)), relay.complete
        )
    with pytest.raises(FailedPreconditionError, match="lease expired"):
        await relay.complete(Completion(reservation.transfer_id, _header(), 0))


@pytest.fixture
def verifying(clock, shm_backend):
    """A relay that checks the region CRC on shm too (``verify_trusted``)."""
    rx = FastLinkReceiver(
        [shm_backend], FastLinkConfig(lease_s=5, verify_trusted=True), clock=clock
    )
    yield rx
    rx.cancel("r")


async def test_shm_skips_the_region_crc_unless_both_ends_ask_for_it(relay):
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request())
    report = await FastLinkSender([ShmSenderBackend()]).send(
        reservation, _header(), BytesSource(payload), relay.complete
    )
    assert report.state is TransferState.COMPLETED and report.crc32 == 0  # nothing hashed
    assert bytes((await relay.wait_complete("r", 1)).view) == payload
    relay.release(reservation.transfer_id)
    hashed = await relay.prepare(_prepare_request())
    report = await FastLinkSender([ShmSenderBackend()], hash_trusted=True).send(
        hashed, _header(), BytesSource(payload), relay.complete
    )
    assert report.state is TransferState.COMPLETED and report.crc32 == zlib.crc32(payload)


async def test_bytes_damaged_in_the_region_fail_the_crc_check(verifying):
    relay = verifying
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request())

    async def damage_then_complete(completion):
        other = ShmWriter(
            reservation.shm_name, reservation.total_bytes
        )  # a second mapping of the segment
        other.view[12345] ^= 0x10  # a bit flips after the sender wrote it
        other.close()
        return await relay.complete(completion) is TransferState.COMPLETED

    report = await FastLinkSender([ShmSenderBackend()], hash_trusted=True).send(
        reservation, _header(), BytesSource(payload), damage_then_complete
    )
    assert report.state is TransferState.FAILED
    assert relay.state(reservation.transfer_id) is TransferState.FAILED
    assert not segment_exists(reservation.shm_name)
    with pytest.raises(DeadlineExceededError, match="not ready"):
        await relay.wait_complete("r", 0.01)


async def test_a_wrong_crc_from_the_sender_fails_the_transfer(verifying):
    relay = verifying
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request())

    async def lie(c):
        return await relay.complete(replace(c, crc32=c.crc32 ^ 1))

    report = await FastLinkSender([ShmSenderBackend()], hash_trusted=True).send(
        reservation, _header(), BytesSource(payload), lie
    )
    assert report.state is TransferState.FAILED and relay.reserved_bytes == 0


async def test_negotiation_and_limits(relay):
    with pytest.raises(UnavailableError, match="no common fast-link transport"):
        await relay.prepare(_prepare_request(transports=(Transport.RDMA,)))
    tcp = await relay.prepare(_prepare_request(transports=(Transport.RDMA, Transport.TCP)))
    assert tcp.transport is Transport.TCP and tcp.shm_name == "" and tcp.lease_ms == 5000
    small = FastLinkReceiver([ShmReceiverBackend()], FastLinkConfig(max_region_bytes=1 << 16))
    with pytest.raises(ResourceExhaustedError, match="exceeds the limit"):
        await small.prepare(_prepare_request())
    with pytest.raises(ValueError, match="^lease_s"):
        FastLinkConfig(lease_s=0)


def test_state_machine_refuses_illegal_transitions():
    assert advance(TransferState.REGISTERED, TransferState.WRITTEN, "t") is TransferState.WRITTEN
    for current, new in [
        (TransferState.COMPLETED, TransferState.FAILED),
        (TransferState.WRITTEN, TransferState.EXPIRED),
        (TransferState.PENDING, TransferState.COMPLETED),
    ]:
        with pytest.raises(FailedPreconditionError, match="cannot go from"):
            advance(current, new, "t")


def test_selection_falls_back_when_pyverbs_finds_no_device():
    here = probe_host()
    assert here.rdma_devices == rdma_devices()
    if not pyverbs_available():
        assert here.rdma_devices == ()
    none = HostProbe(rdma_devices=(), shm=True)
    assert select_transport("auto", same_host=True, probe=none) is Transport.SHM
    assert select_transport("auto", same_host=False, probe=none) is Transport.TCP
    assert select_transport("rdma,tcp", same_host=True, probe=none) is Transport.TCP
    assert (
        select_transport("auto", same_host=True, probe=HostProbe(("mlx5_0",), True))
        is Transport.RDMA
    )
    with pytest.raises(UnavailableError, match="not usable here"):
        select_transport("rdma", probe=none)
    with pytest.raises(UnavailableError):
        select_transport("shm", same_host=False, probe=none)
    with pytest.raises(ValueError, match="^fast_link_transport"):
        select_transport("infiniband", probe=none)
    # what prefill offers the relay: every usable one, in preference order
    assert usable_candidates("auto", True, probe=none) == (Transport.SHM, Transport.TCP)
    assert usable_candidates("TCP, shm", True, probe=none) == (Transport.TCP, Transport.SHM)
    assert usable_candidates("rdma,tcp", False, probe=none) == (Transport.TCP,)
    with pytest.raises(ValueError, match="none of \\['rdma'\\] is usable"):
        usable_candidates("rdma", True, probe=none)


@pytest.mark.rdma
@pytest.mark.skipif(not rdma_devices(), reason="needs an RDMA device")
async def test_rdma_round_trip_on_a_real_device():  # pragma: no cover - needs an RDMA device
    from pdd.kv.fast_link.rdma import RdmaReceiverBackend, RdmaSenderBackend

    rx_backend, tx_backend = RdmaReceiverBackend(), RdmaSenderBackend()
    tx_backend.connect(rx_backend.connect(tx_backend.endpoint()))
    relay = FastLinkReceiver([rx_backend])
    payload = os.urandom(LAYOUT.nbytes(TOKENS))
    reservation = await relay.prepare(_prepare_request(transports=(Transport.RDMA,)))
    report = await FastLinkSender([tx_backend]).send(
        reservation, _header(), BytesSource(payload), relay.complete
    )
    assert report.state is TransferState.COMPLETED
    assert bytes((await relay.wait_complete("r", 5)).view) == payload
    assert torch.equal(
        decode_tensor(bytearray(payload), LAYOUT, TOKENS),
        decode_tensor(bytearray((await relay.wait_complete("r", 5)).view), LAYOUT, TOKENS),
    )
