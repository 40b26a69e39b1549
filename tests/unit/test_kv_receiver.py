"""KvReceiver's registry rules: resume vs conflict, exactly-once delivery, limits, expiry."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdd.core.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from pdd.kv.chunking import ChunkVerdict, split
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.receiver import KvReceiver, ReceiverConfig
from pdd.kv.transfer import Commit, make_header

LAYOUT = KvLayout(KvDtype.FLOAT32, num_layers=1, num_kv_heads=1, head_dim=64)  # 512 B per token


def _transfer(rid: str, num_tokens: int = 16, start: int = 0):
    header = make_header(rid, LAYOUT, start, num_tokens, chunk_bytes=1024)
    payload = os.urandom(header.total_bytes)
    return header, payload, list(split(header, payload))


async def _items(*items):
    for item in items:
        yield item


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_resumed_stream_completes_and_delivers_once():
    delivered = []
    rx = KvReceiver(on_complete=delivered.append)
    header, payload, chunks = _transfer("r")
    first = await rx.receive(_items(header, *chunks[:3]))
    assert first.missing == tuple(range(3, 8)) and not first.complete
    again = await rx.receive(_items(header, *chunks, Commit("r", (5,))))  # resends everything
    assert again.complete and again.missing == ()
    assert len(delivered) == 1 and bytes(delivered[0].payload) == payload
    assert rx.accept(chunks[0]) is ChunkVerdict.DUPLICATE


async def test_redelivery_after_pop_is_prevented():
    delivered = []
    rx = KvReceiver(on_complete=delivered.append)
    header, payload, chunks = _transfer("r")
    await rx.receive(_items(header, *chunks, Commit("r")))
    assert bytes(rx.pop("r").payload) == payload and rx.pop("r") is None
    # The sender lost the response and pushes the same range again.
    status = await rx.receive(_items(header, *chunks, Commit("r")))
    assert status.complete and len(delivered) == 1
    # A new range for the same request is a new transfer.
    nxt, _, nxt_chunks = _transfer("r", start=16)
    await rx.receive(_items(nxt, *nxt_chunks, Commit("r")))
    assert len(delivered) == 2 and delivered[1].header.start_token == 16


async def test_stream_rules_are_enforced():
    rx = KvReceiver()
    header, _, chunks = _transfer("r")
    with pytest.raises(InvalidArgumentError, match="first message"):
        await rx.receive(_items(chunks[0]))
    with pytest.raises(InvalidArgumentError, match="chunk.request_id"):
        await rx.receive(_items(header, _transfer("other")[2][0]))
    other_header, _, _ = _transfer("r", num_tokens=8)
    with pytest.raises(InvalidArgumentError, match="conflicts"):
        rx.open(other_header)
    with pytest.raises(FailedPreconditionError, match="before its header"):
        rx.accept(_transfer("nobody")[2][0])


async def test_inflight_bytes_are_bounded():
    rx = KvReceiver(ReceiverConfig(max_transfer_bytes=8192, max_inflight_bytes=16384))
    rx.open(_transfer("a")[0])
    rx.open(_transfer("b")[0])
    with pytest.raises(ResourceExhaustedError, match="limit 16384"):
        rx.open(_transfer("c")[0])
    with pytest.raises(ResourceExhaustedError, match="exceeds the limit"):
        KvReceiver(ReceiverConfig(max_transfer_bytes=4096)).open(_transfer("d")[0])
    with pytest.raises(ValueError, match="^ttl_s"):
        ReceiverConfig(ttl_s=0)


async def test_idle_transfers_expire_and_free_their_bytes():
    clock = Clock()
    rx = KvReceiver(ReceiverConfig(ttl_s=10), clock=clock)
    header, _, chunks = _transfer("r")
    rx.open(header)
    clock.now = 5
    rx.accept(chunks[0])
    clock.now = 14
    assert rx.expire() == [] and rx.inflight_bytes == header.total_bytes
    clock.now = 15.5
    assert rx.expire() == ["r"] and rx.inflight_bytes == 0 and not rx.status("r").known


async def test_waiters_time_out_or_learn_of_cancellation():
    rx = KvReceiver()
    with pytest.raises(DeadlineExceededError, match="not ready"):
        await rx.wait_complete("r", 0.01)
    header, _, _ = _transfer("r")
    rx.open(header)
    waiter = asyncio.create_task(rx.wait_complete("r", 10))
    await asyncio.sleep(0)
    assert rx.discard("r")
    with pytest.raises(FailedPreconditionError, match="cancelled"):
        await waiter
