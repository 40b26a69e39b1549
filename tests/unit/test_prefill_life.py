"""Prefill's request life against in-process peers: MainDecode's typed client replaced by one
whose ``kv_pusher`` pushes (the real ``KvPusher``) into a real ``KvReceiver``, the relay's by one
answered by a real ``FastLinkReceiver`` over shared memory.

The engine prefills in 16-token chunks, so both pushes are fed while the prompt is still being
computed. What arrives must be exactly the delta ``[main_decode_cached_tokens, n)`` (and, for
the relay, the whole prompt), equal to a fresh engine's export of the same prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from pdd.core.errors import PeerError
from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import FirstToken, PrefillJob, TransferDone
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.kv import messages as kv_messages
from pdd.kv import push_codec
from pdd.kv.compression import decode_tensor
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.kv.fast_link.region import Completion, PrepareRequest, Reservation
from pdd.kv.fast_link.shm import ShmReceiverBackend
from pdd.kv.fast_link.state import TransferState
from pdd.kv.fast_link.tcp import TcpSenderBackend
from pdd.kv.receiver import KvReceiver
from pdd.kv.stream_pool import StreamPool
from pdd.kv.wan import KvPusher
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.model_spec import load_model
from pdd.serving.prefill import Prefill, PrefillConfig, PrefillPeers

MODEL = "tiny:3,ctx=256,layers=2,hidden=64,inter=128"
CONFIG = EngineConfig(block_size=4, max_num_batched_tokens=16)
PROMPT = tuple(1 + (i * 5) % 250 for i in range(120))
MD = InstanceRef("md-0", "md:1", Role.MAIN_DECODE)
RELAY = InstanceRef("relay-0", "relay:1", Role.RELAY)


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def reference(ckpt):
    """A fresh engine's first token and KV ``[n, L, 2, KV, D]`` of ``PROMPT``."""
    eng = Engine(ckpt, CONFIG)
    eng.add_request("x", PROMPT, SamplingParams(max_tokens=1), keep_after_finish=True)
    while not (outs := eng.step()):
        pass
    kv = eng.export_kv("x", 0, len(PROMPT)).to_tensor().permute(2, 0, 1, 3, 4)
    return outs[0].token_id, kv


class InProcessMainDecode:
    """``KvPushClient.kv_pusher``: the real pusher, its stream delivered to a real receiver
    (the servicer's conversions included) instead of a gRPC call."""

    def __init__(self, receiver: KvReceiver, *, latency_s: float = 0.0) -> None:
        self.receiver = receiver
        self.latency_s = latency_s  # NOTE: a slow link: each push holds its slot this much longer

    def kv_pusher(self, pool: StreamPool) -> KvPusher:
        async def push(requests):
            await asyncio.sleep(self.latency_s)

            async def over_the_wire():  # NOTE: each item encoded and read back as the server does
                decoder = push_codec.PushKvDecoder()
                async for item in requests:
                    yield decoder.decode(push_codec.encode_push_item(item))

            items = push_codec.push_items_from_wire(over_the_wire())
            return kv_messages.push_response_to_pb(await self.receiver.receive(items))

        async def get_transfer(request_id: str):
            return kv_messages.transfer_status_to_pb(self.receiver.status(request_id))

        return KvPusher(push, get_transfer, pool=pool)


class InProcessRelay:
    """``FastLinkClient``'s calls answered by a relay's ``FastLinkReceiver`` (shm)."""

    def __init__(self, fast: FastLinkReceiver, *, down: bool = False) -> None:
        self.fast = fast
        self.down = down

    async def prepare_transfer(self, request: PrepareRequest) -> Reservation:
        if self.down:
            raise PeerError("UNAVAILABLE", "connection refused", "relay")
        return await self.fast.prepare(request)

    async def complete_transfer(self, completion: Completion) -> bool:
        return await self.fast.complete(completion) is TransferState.COMPLETED

    def tcp_backend(self) -> TcpSenderBackend:
        async def unreachable(requests):
            raise AssertionError("shared memory was offered; TCP must not be used")

        return TcpSenderBackend(unreachable)


class Node:
    """Prefill on its own engine, with the peers it asked for recorded."""

    def __init__(self, ckpt, relay_down: bool = False) -> None:
        self.engine = Engine(ckpt, CONFIG)
        self.loop = EngineLoop(self.engine)
        self.receiver = KvReceiver()
        self.fast = FastLinkReceiver([ShmReceiverBackend()])
        self.asked: list[tuple[str, ...]] = []
        peers = PrefillPeers(self._main_decode, self._relay)
        self.relay = InProcessRelay(self.fast, down=relay_down)
        config = PrefillConfig(wan_chunk_bytes=1024, fast_link="shm", relay_same_host=True)
        self.prefill = Prefill(_Instance(self.engine, self.loop), config=config, peers=peers)

    def _main_decode(self, address: str, lane: str) -> InProcessMainDecode:
        self.asked.append((address, lane))
        return InProcessMainDecode(self.receiver)

    def _relay(self, address: str) -> InProcessRelay:
        self.asked.append((address,))
        return self.relay

    async def __aenter__(self) -> Node:
        await self.loop.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.loop.stop()


class _Instance:
    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner


def _job(rid: str, pipeline: Pipeline, md_from: int | None) -> PrefillJob:
    """``md_from`` None: MainDecode's hit is bound later (``Prefill.bind``)."""
    relay = RELAY if pipeline is Pipeline.P_RLD_MD else None
    return PrefillJob(rid, PROMPT, SamplingParams(max_tokens=8), "", pipeline, MD, md_from, relay)


async def _events(node: Node, job: PrefillJob) -> tuple[FirstToken, TransferDone]:
    events = [ev async for ev in node.prefill.prefill(job)]
    assert [type(ev) for ev in events] == [FirstToken, TransferDone]
    return events[0], events[1]


async def test_p_md_pushes_exactly_the_delta_main_decode_lacks(ckpt, reference):
    token, kv = reference
    md_from = 40
    async with Node(ckpt) as node:
        first, done = await asyncio.wait_for(_events(node, _job("r1", Pipeline.P_MD, md_from)), 60)
        assert (first.token_id, first.prompt_tokens, first.cached_tokens) == (token, 120, 0)
        assert node.asked == [("md:1", "urgent")]  # P-MD deltas ride the urgent lane
        received = node.receiver.pop("r1")
        assert received.output_token_ids == (token,)  # the commit carries the first token
        header = received.header
        assert (header.start_token, header.num_tokens) == (md_from, 120 - md_from)
        got = decode_tensor(received.payload, header.layout, header.num_tokens)
        torch.testing.assert_close(got, kv[md_from:], rtol=1e-4, atol=1e-5)
        assert done.wan_kv_bytes == header.total_bytes and done.relay_kv_bytes == 0
        assert done.fast_link == ""
        await node.loop.call(lambda: None)
        assert not node.engine.holds_request("r1")  # released right after export


async def test_p_rld_md_sends_the_whole_prompt_to_the_relay_and_the_delta_to_main_decode(
    ckpt, reference
):
    token, kv = reference
    async with Node(ckpt) as node:
        first, done = await asyncio.wait_for(_events(node, _job("r2", Pipeline.P_RLD_MD, 100)), 60)
        assert first.token_id == token
        assert sorted(node.asked) == [("md:1", "bulk"), ("relay:1",)]
        region = await node.fast.wait_complete("r2", 5)
        assert (region.header.start_token, region.header.num_tokens) == (0, 120)
        assert region.output_token_ids == (token,)
        got = decode_tensor(region.view, region.header.layout, 120)
        torch.testing.assert_close(got, kv, rtol=1e-4, atol=1e-5)
        node.fast.release(region.transfer_id)
        wan = node.receiver.pop("r2")
        assert (wan.header.start_token, wan.header.num_tokens) == (100, 20)
        torch.testing.assert_close(
            decode_tensor(wan.payload, wan.header.layout, 20), kv[100:], rtol=1e-4, atol=1e-5
        )
        assert (done.fast_link, done.relay_kv_bytes) == ("shm", region.header.total_bytes)


async def test_a_lost_relay_does_not_fail_the_request(ckpt, reference):
    token, _ = reference
    async with Node(ckpt, relay_down=True) as node:
        first, done = await asyncio.wait_for(_events(node, _job("r3", Pipeline.P_RLD_MD, 0)), 60)
        assert first.token_id == token
        assert (done.fast_link, done.relay_kv_bytes) == ("failed", 0)
        # MainDecode still has the KV over the WAN.
        assert node.receiver.pop("r3").header.num_tokens == 120


async def test_a_request_ended_after_its_first_token_is_dropped(ckpt):
    async with Node(ckpt) as node:
        stream = node.prefill.prefill(_job("r4", Pipeline.P_MD, 0))
        assert isinstance(await anext(stream), FirstToken)
        await stream.aclose()  # the gateway's call ended: the kept request must not linger
        await node.loop.call(lambda: None)
        assert not node.engine.holds_request("r4")
        node.receiver.discard("r4")
        # the id is free again
        first, _ = await asyncio.wait_for(_events(node, _job("r4", Pipeline.P_MD, 0)), 60)
        assert first.prompt_tokens == 120


async def test_a_request_cancelled_while_being_admitted_is_dropped(ckpt):
    """The gateway stops a prefill call within ms when MainDecode refuses the request (prefill is
    opened beside it): cancelled while the engine thread is adding it, the request must still go."""
    import threading

    async with Node(ckpt) as node:
        gate = threading.Event()
        node.loop.submit(gate.wait)  # NOTE: the engine thread is busy: the admission waits
        task = asyncio.ensure_future(anext(node.prefill.prefill(_job("r6", Pipeline.P_MD, None))))
        for _ in range(10):
            await asyncio.sleep(0)  # NOTE: into its admission, queued behind the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the admission runs now, and adds the request
        await node.loop.call(lambda: None)
        assert not node.engine.holds_request("r6")


async def test_a_sent_link_is_freed_without_waiting_for_the_garbage_collector():
    """A link's KV buffer (the request's whole range) must go when the request does, by
    reference count: no cycle through the generator feeding it (``pdd bench soak`` saw prefill's
    memory creep while every request's buffer waited for a full collection)."""
    import gc
    import weakref

    from pdd.kv.layout import KvDtype, KvLayout
    from pdd.kv.transfer import make_header
    from pdd.serving.prefill_feed import KvLink

    layout = KvLayout(KvDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=8)
    header = make_header("r", layout, 0, 6, chunk_bytes=512)  # 256 bytes per token
    link = KvLink(header)
    # NOTE: the engine thread writes ahead of the loop's advances (two steps before either)
    first = link.fill(torch.ones(4, 2, 2, 2, 8), 0)
    second = link.fill(torch.full((2, 2, 2, 2, 8), 2.0), 4)
    link.source.advance(first)
    link.source.advance(second)
    data = await link.source.read(0, header.total_bytes)
    assert data.nbytes == header.total_bytes
    got = torch.frombuffer(bytearray(data), dtype=torch.float32).view(6, 2, 2, 2, 8)
    assert got[:4].eq(1).all() and got[4:].eq(2).all()
    del data
    gone = weakref.ref(link)
    gc.disable()
    try:
        del link
        assert gone() is None, "the link lives on in a reference cycle"
    finally:
        gc.enable()


async def test_a_failed_export_fails_every_link_and_ends_the_feed():
    """An export that raises on the engine thread fails the pushes reading the links' buffers
    (on the event loop), and the feed is over: no retry on the next step, a later call raises."""
    from pdd.kv.layout import KvDtype, KvLayout
    from pdd.kv.transfer import make_header
    from pdd.serving.prefill_feed import KvFeed, KvLink

    class BrokenEngine:
        exports = 0

        def holds_request(self, rid):
            return True

        def num_cached_tokens(self, rid):
            return 4

        def export_kv(self, rid, start, end):
            BrokenEngine.exports += 1
            raise RuntimeError("the pool is gone")

    layout = KvLayout(KvDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=8)
    relay, wan = KvLink(make_header("r", layout, 0, 6)), KvLink(make_header("r", layout, 2, 6))
    posted: list = []
    feed = KvFeed(BrokenEngine(), "r", 6, (relay,), posted.append)
    with pytest.raises(RuntimeError, match="pool is gone"):
        feed.after_step()
    feed.after_step()  # NOTE: over: the next step does not try again
    assert BrokenEngine.exports == 1
    with pytest.raises(RuntimeError, match="pool is gone"):
        feed.join(wan)
    for fn in posted:  # what the engine thread posted to the event loop
        fn()
    with pytest.raises(RuntimeError, match="pool is gone"):
        await relay.source.read(0, 1024)


# --- MainDecode's hit bound after the call opened (the gateway does not wait for MainDecode) ---


async def _bound_when(node: Node, rid: str, gate: asyncio.Event, cached: int) -> None:
    from pdd.core.errors import NotFoundError

    await gate.wait()
    while True:  # NOTE: as the gateway does: the bind may come before the call is open
        try:
            node.prefill.bind(rid, cached)
            return
        except NotFoundError:
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("when", ["at-once", "mid-prompt", "after-first-token"])
async def test_a_prefill_bound_later_pushes_exactly_from_the_bound_count(ckpt, reference, when):
    """Bound before the prompt is computed, while its chunks are, or after its first token: the
    WAN push is ``[cached, n)`` whichever part of it was computed before the bind."""
    token, kv = reference
    md_from = 52
    async with Node(ckpt) as node:
        stream = node.prefill.prefill(_job("b1", Pipeline.P_MD, None))
        gate = asyncio.Event()
        binder = asyncio.create_task(_bound_when(node, "b1", gate, md_from))
        if when == "at-once":
            gate.set()
        elif when == "mid-prompt":
            # NOTE: 16-token chunks: bind once a few are computed, before the prompt's end
            def computed() -> int:  # engine thread, between two steps
                eng = node.engine
                return eng.num_cached_tokens("b1") if eng.holds_request("b1") else 0

            async def some_computed() -> None:
                # NOTE: usually mid-prompt; the request is held until bound, so never stuck
                while await node.loop.call(computed) < 64:
                    await asyncio.sleep(0)
                gate.set()

            watcher = asyncio.create_task(some_computed())
        first = await asyncio.wait_for(anext(stream), 60)
        assert isinstance(first, FirstToken) and first.token_id == token
        if when == "after-first-token":
            assert not node.receiver.status("b1").known  # nothing could be pushed yet
            gate.set()
        elif when == "mid-prompt":
            await watcher
        done = await asyncio.wait_for(anext(stream), 60)
        await binder
        assert isinstance(done, TransferDone)
        received = node.receiver.pop("b1")
        assert received.output_token_ids == (token,)
        header = received.header
        assert (header.start_token, header.num_tokens) == (md_from, 120 - md_from)
        got = decode_tensor(received.payload, header.layout, header.num_tokens)
        torch.testing.assert_close(got, kv[md_from:], rtol=1e-4, atol=1e-5)
        assert done.wan_kv_bytes == header.total_bytes
        await node.loop.call(lambda: None)
        assert not node.engine.holds_request("b1")


async def test_a_p_rld_md_prefill_feeds_the_relay_before_main_decode_is_bound(ckpt, reference):
    """The relay's fast link does not wait for MainDecode's answer: the whole prompt is on it
    while the WAN push still waits for its bind."""
    token, kv = reference
    async with Node(ckpt) as node:
        stream = node.prefill.prefill(_job("b2", Pipeline.P_RLD_MD, None))
        first = await asyncio.wait_for(anext(stream), 60)
        assert first.token_id == token
        region = await node.fast.wait_complete("b2", 10)
        assert (region.header.start_token, region.header.num_tokens) == (0, 120)
        node.fast.release(region.transfer_id)
        node.prefill.bind("b2", 100)
        done = await asyncio.wait_for(anext(stream), 60)
        wan = node.receiver.pop("b2")
        assert (wan.header.start_token, wan.header.num_tokens) == (100, 20)
        torch.testing.assert_close(
            decode_tensor(wan.payload, wan.header.layout, 20), kv[100:], rtol=1e-4, atol=1e-5
        )
        assert done.fast_link == "shm"


async def test_a_bind_names_what_is_wrong_with_it(ckpt):
    from pdd.core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

    async with Node(ckpt) as node:
        with pytest.raises(NotFoundError, match="'nobody' is not being prefilled here"):
            node.prefill.bind("nobody", 0)
        known = node.prefill.prefill(_job("b3", Pipeline.P_MD, 0))
        later = node.prefill.prefill(_job("b4", Pipeline.P_MD, None))
        assert isinstance(await asyncio.wait_for(anext(known), 60), FirstToken)
        assert isinstance(await asyncio.wait_for(anext(later), 60), FirstToken)
        with pytest.raises(FailedPreconditionError, match="already"):
            node.prefill.bind("b3", 0)  # opened with MainDecode's count
        with pytest.raises(InvalidArgumentError, match="main_decode_cached_tokens"):
            node.prefill.bind("b4", 121)
        node.prefill.bind("b4", 120)  # MainDecode holds it all: only the first token crosses
        with pytest.raises(FailedPreconditionError, match="already"):
            node.prefill.bind("b4", 3)
        assert isinstance(await asyncio.wait_for(anext(known), 60), TransferDone)
        assert isinstance(await asyncio.wait_for(anext(later), 60), TransferDone)
        received = node.receiver.pop("b4")
        assert (received.header.start_token, received.header.num_tokens) == (120, 0)


async def test_a_prefill_never_bound_gives_up_and_frees_the_request(ckpt):
    from pdd.core.errors import DeadlineExceededError

    async with Node(ckpt) as node:
        node.prefill.config = replace(node.prefill.config, bind_timeout_s=0.3)
        stream = node.prefill.prefill(_job("b5", Pipeline.P_MD, None))
        assert isinstance(await asyncio.wait_for(anext(stream), 60), FirstToken)
        with pytest.raises(DeadlineExceededError, match="not bound within 0.3 s"):
            await asyncio.wait_for(anext(stream), 60)
        await node.loop.call(lambda: None)
        assert not node.engine.holds_request("b5")
        assert not node.receiver.status("b5").known
        with pytest.raises(Exception, match="not being prefilled"):
            node.prefill.bind("b5", 0)


async def test_the_first_token_leaves_before_the_last_part_is_exported(
    ckpt, reference, monkeypatch
):
    """The part computed with the token is exported on the engine thread right after its step,
    but after the step's outputs were handed on: the token never waits for that export (in a
    burst that ends in one step, each token used to wait behind the others' exports). Here the
    last export is held until the token is out. The relay and MainDecode still get all the KV."""
    import threading

    from pdd.serving.prefill_feed import KvFeed

    token, kv = reference
    exports: list[tuple[int, int]] = []
    token_out = threading.Event()
    released: list[bool] = []
    real = KvFeed._export

    def held_export(self, start, end, links):
        exports.append((start, end))
        if end == self.prompt_len:
            released.append(token_out.wait(30))  # NOTE: the engine thread waits for the token
        return real(self, start, end, links)

    monkeypatch.setattr(KvFeed, "_export", held_export)
    async with Node(ckpt) as node:
        stream = node.prefill.prefill(_job("t1", Pipeline.P_RLD_MD, 40))
        try:
            async with asyncio.timeout(20):
                first = await anext(stream)
        finally:
            token_out.set()
        async with asyncio.timeout(60):
            done = await anext(stream)
        assert first.token_id == token and done.fast_link == "shm"
        assert released == [True], "the last export ran before the token was out"
        # the relay's link took the prompt step by step ([0, 16), [16, 32), ...) and the WAN link
        # joined with what was computed by then; the last export ends the prompt
        assert exports[0][0] == 0 and exports[-1][1] == 120
        region = await node.fast.wait_complete("t1", 10)
        assert (region.header.start_token, region.header.num_tokens) == (0, 120)
        node.fast.release(region.transfer_id)
        wan = node.receiver.pop("t1")
        torch.testing.assert_close(
            decode_tensor(wan.payload, wan.header.layout, 80), kv[40:], rtol=1e-4, atol=1e-5
        )
