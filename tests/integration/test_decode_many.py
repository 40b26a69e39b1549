"""MainDecode's shared decode stream (``DecodeMany``) end to end over a real gRPC server.

The server half (``pdd.wire.decode_many``) runs a scripted decode — the request life is
MainDecode's own and is tested where it lives — behind the real bootstrap (interceptors, error
mapping, graceful stop); the gateway's half (``pdd.wire.decode_mux``) is read as the gateway
reads a ``Decode`` call. What one engine step makes for many requests must go out as one
message; each call must end with its own status; a cancel, a deadline, a broken stream and a
server that stops must each end exactly the calls they concern, and nothing may be left
running at the server.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdd.core.errors import PeerError, ResourceExhaustedError
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import Accepted, DecodeJob, Finished, Tokens
from pdd.engine.sampling import SamplingParams
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import GrpcServer, ServiceSpec
from pdd.server.config import ServerConfig
from pdd.wire import main_decode as conv
from pdd.wire.decode_many import DecodeManyStreams
from pdd.wire.decode_mux import DecodeMux

VOCAB = 256


class Steps:
    """An engine's steps, taken by the test: every waiting request gets its token at once."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.waiting = 0

    async def wait(self) -> None:
        self.waiting += 1
        await self._event.wait()

    def take(self) -> None:
        """Release every request waiting now (those woken no longer count as waiting)."""
        self._event.set()
        self._event, self.waiting = asyncio.Event(), 0


class Script(pb_grpc.MainDecodeServiceServicer):
    """A MainDecode whose requests produce one token per step; ``fail-*`` requests are refused
    after Accepted, ``hang-*`` ones wait forever. Records which requests are open."""

    def __init__(self) -> None:
        self.steps = Steps()
        self.open: set[str] = set()
        self.closed: list[str] = []
        self.many = DecodeManyStreams(self.decode, lambda: VOCAB, "md-x")

    async def decode(self, job: DecodeJob):
        rid, n = job.request_id, job.sampling.max_tokens
        self.open.add(rid)
        try:
            yield Accepted(3)
            if rid.startswith("fail"):
                raise ResourceExhaustedError("kv: the pool is full")
            if rid.startswith("hang"):
                await asyncio.Event().wait()
            for p in range(n):
                await self.steps.wait()
                yield Tokens(p, (10 + p,))
            yield Finished("length", n, n)
        finally:
            self.open.discard(rid)
            self.closed.append(rid)

    async def DecodeMany(self, request_iterator, context):
        async for msg in self.many.serve(request_iterator):
            yield msg


class Node:
    def __init__(self, port: int = 0, grace_s: float = 0.5) -> None:
        self.script = Script()
        spec = ServiceSpec(
            "main_decode",
            [pb.DESCRIPTOR.services_by_name["MainDecodeService"].full_name],
            lambda server: pb_grpc.add_MainDecodeServiceServicer_to_server(self.script, server),
            draining=self.script.many.drain,
        )
        self.server = GrpcServer(ServerConfig(port=port, grace_s=grace_s), spec)

    async def __aenter__(self) -> Node:
        self.port = await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()


def job(rid: str, n: int = 3, prompt: tuple[int, ...] = (1, 2, 3)) -> DecodeJob:
    return DecodeJob(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), "", Pipeline.P_MD)


async def until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


async def drain(stream) -> list:
    return [ev async for ev in stream]


@pytest.fixture
async def node():
    async with Node() as n:
        yield n


async def test_one_step_of_many_requests_is_one_message(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        call = pb_grpc.MainDecodeServiceStub(channel).DecodeMany()
        for i in range(1, 9):
            await call.write(conv.start_to_pb(conv.StartCall(i, job(f"r{i}"), None)))
        accepted = 0
        while accepted < 8:  # however the Accepted events came
            msg = await call.read()
            accepted += sum(ev.WhichOneof("event") == "accepted" for ev in msg.events)
        rest = []
        for p in range(3):
            await until(lambda: node.script.steps.waiting == 8)
            node.script.steps.take()
            msg = await call.read()  # the step: every request's token in one message
            tokens = [ev for ev in msg.events if ev.WhichOneof("event") == "tokens"]
            assert sorted(ev.call_id for ev in tokens) == list(range(1, 9)), msg
            assert {(ev.tokens.start_position, tuple(ev.tokens.token_ids)) for ev in tokens} == {
                (p, (10 + p,))
            }
            rest += [ev for ev in msg.events if ev.WhichOneof("event") != "tokens"]
        await call.done_writing()
        while (msg := await call.read()) is not grpc.aio.EOF:
            rest += msg.events
        kinds = [ev.WhichOneof("event") for ev in rest]
        assert kinds.count("finished") == 8 and kinds.count("end") == 8, kinds
        assert all(ev.end.code == 0 for ev in rest if ev.WhichOneof("event") == "end")
        assert await call.code() == grpc.StatusCode.OK  # every call ended, then the stream


async def test_calls_read_like_decode_calls_each_with_its_own_end(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        mux = DecodeMux(channel)
        ok = [mux.open(job(f"ok{i}", n=4), 30) for i in range(3)]
        bad = mux.open(job("bad", prompt=(1, 999)), 30)
        full = mux.open(job("fail-1"), 30)
        with pytest.raises(PeerError) as refused:
            await drain(bad)
        assert refused.value.code == "INVALID_ARGUMENT"
        assert refused.value.details.startswith("prompt_token_ids[1]")
        assert await full.read() == Accepted(3)
        with pytest.raises(PeerError, match="the pool is full") as exhausted:
            await full.read()
        assert exhausted.value.code == "RESOURCE_EXHAUSTED"
        reads = [asyncio.create_task(drain(s)) for s in ok]
        for _ in range(4):
            await until(lambda: node.script.steps.waiting == 3)
            node.script.steps.take()
        for events in await asyncio.gather(*reads):
            assert events == [
                Accepted(3),
                *[Tokens(p, (10 + p,)) for p in range(4)],
                Finished("length", 4, 4),
            ]
        assert await ok[0].read() is None  # a call that ended stays ended
        assert mux.running == 0 and not node.script.open
        await mux.close()


async def test_a_piped_call_hands_every_event_and_one_end_to_its_callbacks(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        mux = DecodeMux(channel)
        got: dict[str, list] = {"ok": [], "fail-1": [], "hang-x": []}
        ends: dict[str, list] = {k: [] for k in got}
        calls = {rid: mux.open(job(rid, n=3), 30) for rid in got}
        for rid, call in calls.items():
            assert await call.read() == Accepted(3)  # read first, as the gateway does
            await asyncio.sleep(0.05)  # what arrives meanwhile waits in the call's queue
            call.pipe(got[rid].append, ends[rid].append)
        for _ in range(3):
            await until(lambda: node.script.steps.waiting == 1)
            node.script.steps.take()
        await until(lambda: ends["ok"] and ends["fail-1"])
        assert got["ok"] == [*[Tokens(p, (10 + p,)) for p in range(3)], Finished("length", 3, 3)]
        assert ends["ok"] == [None]
        assert got["fail-1"] == [] and [e.code for e in ends["fail-1"]] == ["RESOURCE_EXHAUSTED"]
        calls["hang-x"].cancel()
        calls["hang-x"].cancel()  # a second cancel ends nothing twice
        assert [e.cancelled for e in ends["hang-x"]] == [True] and got["hang-x"] == []
        await until(lambda: not node.script.open)
        assert mux.running == 0
        await mux.close()


async def test_a_cancel_or_a_deadline_ends_only_its_call(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        mux = DecodeMux(channel)
        keep = mux.open(job("ok-keep", n=1), 30)
        gone = mux.open(job("hang-cancelled"), 30)
        late = mux.open(job("hang-late"), 0.4)
        for s in (keep, gone, late):
            assert await s.read() == Accepted(3)
        pending = asyncio.create_task(gone.read())
        await asyncio.sleep(0)  # NOTE: one turn of the loop: the read is now waiting
        gone.cancel()
        with pytest.raises(PeerError) as cancelled:
            await pending
        assert cancelled.value.cancelled
        t0 = time.monotonic()
        with pytest.raises(PeerError) as expired:
            await late.read()
        assert expired.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 5
        await until(lambda: node.script.open == {"ok-keep"})  # both freed at the server
        await until(lambda: node.script.steps.waiting == 1)
        node.script.steps.take()
        assert await drain(keep) == [Tokens(0, (10,)), Finished("length", 1, 1)]
        await mux.close()


async def test_the_server_enforces_a_calls_deadline_too(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        call = pb_grpc.MainDecodeServiceStub(channel).DecodeMany()
        start = conv.start_to_pb(conv.StartCall(7, job("hang-x"), None))
        start.timeout_ms = 300
        await call.write(start)
        events = []
        while not any(ev.WhichOneof("event") == "end" for ev in events):
            events += (await call.read()).events
        end = events[-1].end
        assert end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "hang-x" in node.script.closed
        call.cancel()


async def test_a_broken_stream_fails_its_calls_unavailable_and_the_next_one_reconnects():
    async with Node(grace_s=0.2) as first:
        port = first.port
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = DecodeMux(channel)
        stuck = [mux.open(job(f"hang-{i}"), 30) for i in range(3)]
        for s in stuck:
            assert await s.read() == Accepted(3)
    # the server stopped: its grace ran out with the calls still running
    for s in stuck:
        with pytest.raises(PeerError) as lost:
            await s.read()
        assert lost.value.code == "UNAVAILABLE" and lost.value.lost
    assert not first.script.open
    async with Node(port=port) as second:
        again = mux.open(job("ok-again", n=1), 30)
        assert await again.read() == Accepted(3)
        await until(lambda: second.script.steps.waiting == 1)
        second.script.steps.take()
        assert await drain(again) == [Tokens(0, (10,)), Finished("length", 1, 1)]
        await mux.close()
    await channel.close()


async def test_a_stopping_server_lets_running_calls_finish_and_refuses_new_ones():
    node = Node(grace_s=30)
    await node.__aenter__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{node.port}")
    mux = DecodeMux(channel)
    running = mux.open(job("ok-running", n=2), 30)
    assert await running.read() == Accepted(3)
    t0 = time.monotonic()
    stopping = asyncio.create_task(node.server.stop())
    await until(lambda: node.script.many.draining)
    refused = mux.open(job("ok-new"), 30)
    with pytest.raises(PeerError) as late:
        await refused.read()
    assert late.value.code == "UNAVAILABLE"
    for _ in range(2):
        await until(lambda: node.script.steps.waiting == 1)
        node.script.steps.take()
    assert await drain(running) == [Tokens(0, (10,)), Tokens(1, (11,)), Finished("length", 2, 2)]
    await stopping
    assert time.monotonic() - t0 < 10  # its stream ended with its calls, not after the grace
    await mux.close()
    await channel.close()


async def test_a_reused_call_id_or_bytes_that_do_not_parse_end_the_stream(node):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        stub = pb_grpc.MainDecodeServiceStub(channel)
        call = stub.DecodeMany()
        await call.write(conv.start_to_pb(conv.StartCall(5, job("hang-a"), None)))
        await call.write(conv.start_to_pb(conv.StartCall(5, job("hang-b"), None)))
        with pytest.raises(grpc.aio.AioRpcError) as reused:
            while await call.read() is not grpc.aio.EOF:  # hang-a's Accepted, then the status
                pass
        assert reused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reused.value.details().startswith("call_id: 5 is already running")
        await until(lambda: not node.script.open)  # what the stream ran was stopped
        raw = channel.stream_stream(
            "/pdd.main_decode.v1.MainDecodeService/DecodeMany",
            request_serializer=None,
            response_deserializer=None,
        )()
        await raw.write(b"\xff\xff\xff")
        await raw.done_writing()
        assert await raw.code() == grpc.StatusCode.INVALID_ARGUMENT
        unnamed = stub.DecodeMany()
        await unnamed.write(pb.DecodeManyRequest(decode=conv.job_to_pb(job("x"))))
        await unnamed.done_writing()
        assert await unnamed.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await unnamed.details()).startswith("call_id: must be set")


def test_the_wire_items_round_trip():
    start = conv.StartCall(9, job("r", prompt=(4, 5)), 1.5)
    assert conv.many_request_from_pb(conv.start_to_pb(start), VOCAB) == start
    cancel = conv.CancelCall(9)
    assert conv.many_request_from_pb(conv.cancel_to_pb(cancel), VOCAB) == cancel
    end = conv.CallEnded("RESOURCE_EXHAUSTED", "kv: full")
    msg = pb.DecodeManyResponse(
        events=[
            conv.event_to_pb(Tokens(2, (7, 8)), "md", pb.DecodeManyEvent, call_id=3),
            conv.ended_to_pb(4, end),
        ]
    )
    assert conv.many_events_from_pb(msg) == [(3, Tokens(2, (7, 8))), (4, end)]
    with pytest.raises(Exception, match="action"):
        conv.many_request_from_pb(pb.DecodeManyRequest(call_id=1), VOCAB)
