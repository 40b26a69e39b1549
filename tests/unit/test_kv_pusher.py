"""The pusher's back-pressure and retry budget, and the stream pool's queue, without a network.

The "network" here is a push callable that consumes the request stream the way
gRPC does; the thing under test (``KvPusher``, ``StreamPool``) is real.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdd.core.errors import FailedPreconditionError, UnavailableError
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.source import BytesSource, FilledSource, StreamedSource
from pdd.kv.transfer import Chunk, make_header
from pdd.kv.wan import KvPusher, PusherConfig, StreamPool

LAYOUT = KvLayout(
    KvDtype.FLOAT16, num_layers=1, num_kv_heads=1, head_dim=256, axes="layer,token,head,dim"
)
CHUNK = 4 * LAYOUT.bytes_per_token  # 2 KiB: 4 tokens per chunk


def _complete(rid: str, n: int) -> mdpb.PushKvResponse:
    return mdpb.PushKvResponse(request_id=rid, complete=True, chunks_received=n)


async def _never_asked(rid: str) -> mdpb.GetKvTransferResponse:
    raise AssertionError("get_transfer should not be needed")


async def _yield_loop(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


@pytest.mark.parametrize("buffered", [1, 3])
async def test_producer_is_pulled_at_most_a_bounded_number_of_chunks_ahead(buffered):
    header = make_header("r", LAYOUT, 0, 160, chunk_bytes=CHUNK)  # 40 chunks

    async def producer():
        for _ in range(header.num_chunks):
            yield bytes(CHUNK)

    source = StreamedSource(header.total_bytes, producer())
    leads = []

    async def slow_wire(requests):
        sent = 0
        async for msg in requests:
            sent += isinstance(msg, Chunk)
            await _yield_loop()  # the wire is slow: give the encoder every chance to run ahead
            leads.append(source.produced // CHUNK - sent)
        return _complete("r", sent)

    await KvPusher(slow_wire, _never_asked, config=PusherConfig(max_buffered_chunks=buffered)).push(
        header, source
    )
    # Queue of `buffered`, plus the one the encoder holds while waiting to enqueue it.
    assert max(leads) == buffered + 1


async def test_push_starts_before_the_producer_has_finished():
    header = make_header("r", LAYOUT, 0, 80, chunk_bytes=CHUNK)  # 20 chunks
    later_layers = asyncio.Event()
    sent: list[int] = []

    async def producer():
        for i in range(header.num_chunks):
            if i == 10:
                await later_layers.wait()
            yield bytes([i]) * CHUNK

    source = StreamedSource(header.total_bytes, producer())

    async def wire(requests):
        async for msg in requests:
            if isinstance(msg, Chunk):
                sent.append(msg.index)
                assert msg.data == bytes([msg.index]) * CHUNK
        return _complete("r", len(sent))

    push = asyncio.create_task(KvPusher(wire, _never_asked).push(header, source))
    await _yield_loop(200)
    assert sent == list(range(10)) and source.produced == 10 * CHUNK and not push.done()
    later_layers.set()
    await push
    assert sent == list(range(20))


async def test_a_failing_producer_fails_the_push_without_retrying():
    header = make_header("r", LAYOUT, 0, 40, chunk_bytes=CHUNK)
    streams = []

    async def producer():
        yield bytes(CHUNK)

    async def wire(requests):
        streams.append(1)
        async for _ in requests:
            pass
        return _complete("r", 0)

    with pytest.raises(FailedPreconditionError, match="producer stopped"):
        await KvPusher(wire, _never_asked).push(
            header, StreamedSource(header.total_bytes, producer())
        )
    assert streams == [1]


async def test_retry_budget_is_bounded_and_resumes_ask_what_is_missing():
    header = make_header("r", LAYOUT, 0, 40, chunk_bytes=CHUNK)
    asked = []

    async def broken_wire(requests):
        async for msg in requests:
            if isinstance(msg, Chunk):
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "connection reset",
                )
        raise AssertionError("unreachable")

    async def get_transfer(rid):
        asked.append(rid)
        return mdpb.GetKvTransferResponse(
            known=True, num_chunks=header.num_chunks, missing_chunk_indices=range(header.num_chunks)
        )

    config = PusherConfig(max_retries=2, backoff_s=0.0, backoff_max_s=0.0)
    with pytest.raises(UnavailableError, match="after 3 streams"):
        await KvPusher(broken_wire, get_transfer, config=config).push(
            header, BytesSource(bytes(header.total_bytes))
        )
    assert asked == ["r", "r"]


async def test_pool_hands_slots_over_in_fifo_order_and_survives_cancelled_waiters():
    pool = StreamPool(1)
    order: list[str] = []
    release = asyncio.Event()

    async def user(name: str):
        async with pool.slot():
            order.append(name)
            await release.wait()

    first = asyncio.create_task(user("a"))
    await _yield_loop()
    waiters = {n: asyncio.create_task(user(n)) for n in "bcd"}
    await _yield_loop()
    assert pool.in_use == 1 and pool.waiting == 3
    waiters["c"].cancel()
    await _yield_loop()
    assert pool.waiting == 2
    release.set()
    await asyncio.gather(first, waiters["b"], waiters["d"])
    assert order == ["a", "b", "d"] and pool.in_use == 0 and pool.peak_in_use == 1
    assert pool.max_wait_s > 0
    with pytest.raises(ValueError, match="^limit"):
        StreamPool(0)


async def test_a_push_still_being_computed_holds_no_slot():
    """A push whose first chunk is not computed yet waits outside the pool: a push that is ready
    goes first through the link's only slot instead of queueing behind it."""
    pool = StreamPool(1)
    late = make_header("late", LAYOUT, 0, 8, chunk_bytes=CHUNK)
    ready = make_header("ready", LAYOUT, 0, 8, chunk_bytes=CHUNK)
    late_source = FilledSource(late.total_bytes)
    finished: list[str] = []

    async def wire(requests):
        rid, n = "", 0
        async for msg in requests:
            rid = getattr(msg, "request_id", rid)
            n += isinstance(msg, Chunk)
        finished.append(rid)
        return _complete(rid, n)

    pusher = KvPusher(wire, _never_asked, pool=pool)
    waiting = asyncio.create_task(pusher.push(late, late_source))
    await _yield_loop()
    assert pool.in_use == 0 and pool.waiting == 0  # computing: no slot taken, none asked for
    report = await asyncio.wait_for(pusher.push(ready, BytesSource(bytes(ready.total_bytes))), 10)
    assert finished == ["ready"] and report.request_id == "ready" and not waiting.done()
    late_source.advance(late.total_bytes)  # computed: now it takes the slot and goes
    await asyncio.wait_for(waiting, 10)
    assert finished == ["ready", "late"] and pool.in_use == 0
