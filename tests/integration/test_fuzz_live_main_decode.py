"""Hostile KV pushes and token handoffs for requests that are live on a MainDecode.

A MainDecode on a tiny random model serves behind a real gRPC server on port 0 (the real
servicer, the interceptors' error mapping). Each hypothesis example opens live requests in
process and, while they wait for their KV (``PushKv``) or are being handed over
(``TokenHandoff``), sends hostile streams over gRPC: chunks of wrong size, offset or index, bad
checksums, another live request's id or none, duplicates, out-of-order chunks, items after the
commit, headers that are not the KV the request waits for; handoff batches for no request, for a
P-MD request, switching requests mid-stream, out of the vocabulary, leaving a gap, rewriting
what was handed over, duplicated, and after the final batch.

Each hostile stream must end with the status (and field, at the head of the message) that a
model of the rules predicts, from what earlier streams of the example did. Afterwards the real
push / the real relay's batches complete every live request, whose greedy output must equal a
single in-process engine's (up to a near-tie: ``tests/conftest.py``), with no token streamed
twice. The cases run are counted and printed, with a floor.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import Accepted, DecodeJob, Finished, HandoffBatch, Tokens
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.kv import messages as kv_convert
from pdd.kv.chunking import split
from pdd.kv.layout import KvLayout
from pdd.kv.receiver import KvReceiver
from pdd.kv.source import BytesSource
from pdd.kv.transfer import Chunk, Commit, TransferHeader, make_header
from pdd.kv.wan import KvPusher, PusherConfig
from pdd.server.bootstrap import GrpcServer, ServiceSpec
from pdd.server.config import ServerConfig
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.kv_bridge import engine_layout, export_tokens, wire_bytes
from pdd.serving.main_decode import MainDecode
from pdd.serving.model_spec import load_model
from pdd.wire.main_decode_client import MainDecodeClient
from services.main_decode.server import MainDecodeServicer, register_servicer

MODEL = "tiny:3,ctx=256,layers=2,hidden=64,inter=128"
VOCAB = 256
BLOCK = 4
PROMPT = tuple(1 + (i * 7) % 250 for i in range(22))
CHUNK_BYTES = 2048  # the prompt's KV is 11 chunks
N_KV = 8  # outputs of a request fed by a push
N_HANDOFF = 160  # outputs of a request handed over: still decoding when the hostile batches come
K1, K2 = 4, 10  # the real relay's first batch ends at K1, its final one at K2 (or later)
EXAMPLES = 50
CALL_TIMEOUT_S = 15.0
FAST = PusherConfig(backoff_s=0.0, backoff_max_s=0.0)
IA, NF, FP, OK = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OK,
)


def _engine(ckpt) -> Engine:
    return Engine(ckpt, EngineConfig(block_size=BLOCK, num_blocks=512))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def oracle(llama_oracle, ckpt):
    return llama_oracle(ckpt)


@dataclass(frozen=True)
class Prefilled:
    """Prefill's side, computed once: the prompt's KV as it crosses the WAN, its first token."""

    layout: KvLayout
    payload: bytes
    first: int

    def header(self, rid: str, salt: str, start: int, **kw) -> TransferHeader:
        kw = {"token_ids": PROMPT, "cache_salt": salt, "chunk_bytes": CHUNK_BYTES} | kw
        return make_header(rid, kw.pop("layout", self.layout), start, len(PROMPT) - start, **kw)

    def delta(self, start: int) -> bytes:
        return self.payload[start * self.layout.bytes_per_token :]


@pytest.fixture(scope="module")
def prefilled(ckpt) -> Prefilled:
    eng = _engine(ckpt)
    eng.add_request("p", list(PROMPT), _greedy(1), keep_after_finish=True)
    while not (outs := eng.step()):
        pass
    layout = engine_layout(eng)
    kv = export_tokens(eng, "p", 0, len(PROMPT))  # [n, L, 2, KV, D]
    return Prefilled(layout, bytes(wire_bytes(kv, layout)), outs[0].token_id)


@pytest.fixture(scope="module")
def reference(ckpt) -> list[int]:
    """A single engine's greedy outputs of ``PROMPT``: what every live request must produce."""
    return _engine(ckpt).generate([list(PROMPT)], _greedy(N_HANDOFF))[0]


class _Instance:
    """What MainDecode and its servicer read of an ``EngineInstance``."""

    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner
        self.config = SimpleNamespace(ref=InstanceRef("md-fuzz", "127.0.0.1:1", Role.MAIN_DECODE))


class Node:
    """The MainDecode under test behind its gRPC server, and the clients that reach it."""

    async def start(self, ckpt) -> Node:
        self.engine = _engine(ckpt)
        self.loop = EngineLoop(self.engine)
        self.receiver = KvReceiver()
        instance = _Instance(self.engine, self.loop)
        self.md = MainDecode(instance, self.receiver, kv_timeout_s=30)
        servicer = MainDecodeServicer(instance, self.md, self.receiver)
        spec = ServiceSpec(
            "main_decode",
            [md_pb.DESCRIPTOR.services_by_name["MainDecodeService"].full_name],
            lambda server: register_servicer(servicer, server),  # NOTE: as the service does
        )
        self.server = GrpcServer(ServerConfig(port=0, grace_s=0.5), spec)
        await self.loop.start()
        address = f"127.0.0.1:{await self.server.start()}"
        self.channel = grpc.aio.insecure_channel(address)
        # NOTE: hostile client streams go through the sync API: grpc's asyncio client may
        # replace the status of a server that refuses a stream early with INTERNAL when a write
        # then fails (grpc/grpc#36066); the sync client keeps the server's answer.
        self.sync_channel = grpc.insecure_channel(address)
        self.sync = md_grpc.MainDecodeServiceStub(self.sync_channel)
        self.pusher = KvPusher.for_channel(self.channel, config=FAST)
        self.client = MainDecodeClient(self.channel)
        self.opened: list[Live] = []  # this example's live requests
        return self

    async def end_example(self) -> None:
        """Cancel what an example left open (hypothesis may stop one at any draw): MainDecode
        aborts those requests, as when the gateway's call ends."""
        tasks = [live.task for live in self.opened if live.task and not live.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.opened.clear()

    async def stop(self) -> None:
        self.sync_channel.close()
        await self.channel.close()
        await self.server.stop()
        await self.loop.stop()

    async def push(self, msgs: list[md_pb.PushKvRequest]):
        return await asyncio.to_thread(_sync_push, self.sync, msgs)

    async def handoff(self, msgs: list[md_pb.TokenHandoffRequest]):
        return await asyncio.to_thread(_sync_handoff, self.sync, msgs)


def _sync_push(stub, msgs):
    try:
        return OK, "", stub.PushKv(iter(msgs), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def _sync_handoff(stub, msgs):
    acks = []
    try:
        for ack in stub.TokenHandoff(iter(msgs), timeout=CALL_TIMEOUT_S):
            acks.append(ack)
        return OK, "", acks
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", acks


class Live:
    """A live request opened in process, its events read by a task. The reader stops at the
    first ``Tokens`` until ``gate`` is set: the request stays open while the test goes on."""

    def __init__(self, node: Node, rid: str, salt: str, pipeline: Pipeline, n: int) -> None:
        self.node, self.rid, self.salt, self.n = node, rid, salt, n
        self.stream = node.md.decode(DecodeJob(rid, PROMPT, _greedy(n), salt, pipeline))
        self.gate, self.speaking = asyncio.Event(), asyncio.Event()
        self.cached = -1
        self.task: asyncio.Task | None = None

    async def open(self) -> Live:
        accepted = await anext(self.stream)
        assert isinstance(accepted, Accepted)
        self.cached = accepted.cached_tokens
        self.task = asyncio.create_task(self._read())
        self.node.opened.append(self)
        return self

    async def _read(self) -> list:
        events = []
        try:
            async for ev in self.stream:
                events.append(ev)
                if isinstance(ev, Tokens) and not self.gate.is_set():
                    self.speaking.set()
                    await self.gate.wait()
        finally:
            await self.stream.aclose()  # NOTE: cancelled at the gate: the call ends there too
        return events

    async def events(self) -> list:
        self.gate.set()
        assert self.task is not None
        return await asyncio.wait_for(self.task, 120)


def _stream_tokens(events: list) -> tuple[int, list[int], Finished]:
    """The first position streamed, the tokens (contiguous, none twice) and the end."""
    tokens = [ev for ev in events if isinstance(ev, Tokens)]
    assert tokens and isinstance(events[-1], Finished), events
    out: list[int] = []
    for ev in tokens:
        assert ev.start_position == tokens[0].start_position + len(out), f"gap or repeat: {events}"
        out += ev.token_ids
    return tokens[0].start_position, out, events[-1]


def _run_examples(ckpt, body) -> int:
    """Run ``body(node, draw, k)`` for each hypothesis example on one loop, against one
    MainDecode; how many examples ran to their end."""
    loop = asyncio.new_event_loop()
    node = loop.run_until_complete(Node().start(ckpt))
    counter, completed = itertools.count(), []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        # NOTE: no shrinking: the examples share one MainDecode, so a replay is not the same case;
        # the first failure is reported as it happened.
        phases=[Phase.generate],
    )
    @given(data=st.data())
    def example(data):
        try:
            k = next(counter)
            loop.run_until_complete(asyncio.wait_for(body(node, data.draw, k), 300))
            completed.append(k)
        finally:
            loop.run_until_complete(node.end_example())

    try:
        example()
    finally:
        loop.run_until_complete(node.stop())
        loop.close()
    return len(completed)


def _assert_status(got, expected, what) -> None:
    code, details = got
    want_code, want_field = expected
    codes = want_code if isinstance(want_code, tuple) else (want_code,)
    assert code in codes, f"{what}: {code.name} {details!r}, expected {want_code} {want_field!r}"
    if code is not OK:
        assert details.startswith(want_field), f"{what}: {details!r} does not name {want_field!r}"


# --- 1. hostile KV chunks for a transfer that is live --------------------------------------------


@dataclass
class PushTarget:
    """A live P-MD request waiting for its KV, and what the receiver holds of it (the model)."""

    live: Live
    header: TransferHeader
    chunks: list[Chunk]
    first: int
    held: set[int] = field(default_factory=set)
    committed: bool = False
    opened: bool = False

    @property
    def rid(self) -> str:
        return self.live.rid

    @property
    def delivered(self) -> bool:
        return self.committed and len(self.held) == len(self.chunks)

    def commit(self, tokens: tuple[int, ...] | None = None) -> md_pb.PushKvRequest:
        tokens = (self.first,) if tokens is None else tokens
        return kv_convert.push_request_to_pb(Commit(self.rid, tokens))


def _pb(item) -> md_pb.PushKvRequest:
    return kv_convert.push_request_to_pb(item)


def _header_faults(me: PushTarget, other: PushTarget, pre: Prefilled) -> dict:
    """Headers for ``me`` that are not the KV it waits for, each with the field it breaks."""
    rid, salt, start = me.rid, me.live.salt, me.live.cached
    wrong = list(PROMPT)
    wrong[-1] = (wrong[-1] + 1) % VOCAB
    fewer_layers = replace(pre.layout, num_layers=pre.layout.num_layers + 1)
    no_kv = replace(pre.layout, axes="token,layer,head,dim")
    return {
        "header.start_token": pre.header(rid, salt, start + BLOCK),
        "header.num_tokens": make_header(
            rid, pre.layout, start, len(PROMPT) - start - 1, token_ids=PROMPT, cache_salt=salt
        ),
        "header.token_ids": pre.header(rid, salt, start, token_ids=tuple(wrong)),
        "header.cache_salt": pre.header(rid, other.live.salt, start),
        "header.layout": pre.header(rid, salt, start, layout=fewer_layers),
        "header.layout.axes": pre.header(rid, salt, start, layout=no_kv),
    }


PUSH_KINDS = [
    "legit",
    "bad_crc",
    "wrong_size",
    "wrong_offset",
    "wrong_index",
    "foreign_chunk",
    "foreign_commit",
    "bad_commit",
    "after_commit",
    "two_headers",
    "chunk_first",
    "empty",
    "bad_header",
    "other_request",
    "no_request",
]


def _hostile_push(draw, me: PushTarget, other: PushTarget, pre: Prefilled, k: int):
    """One hostile stream at ``me``: messages and the expected (code, field). The model of what
    the receiver holds is updated with what the stream's items before its fault do."""
    kind = draw(st.sampled_from(PUSH_KINDS))
    m = len(me.chunks)
    order = draw(st.lists(st.integers(0, m - 1), max_size=m + 3))  # any order, duplicates
    msgs = [_pb(me.header)] + [_pb(me.chunks[i]) for i in order]

    def apply_prefix() -> None:
        me.opened = True
        me.held.update(order)

    if kind == "legit":
        apply_prefix()
        if draw(st.booleans()):
            msgs.append(me.commit())
            me.committed = True
        return kind, msgs, (OK, "")
    if kind == "bad_crc":
        i = draw(st.integers(0, m - 1))
        c = me.chunks[i]
        msgs.append(_pb(replace(c, data=bytes([c.data[0] ^ 0xFF]) + bytes(c.data[1:]))))
        apply_prefix()
        return kind, msgs, (OK, "")  # NOTE: stays missing: the sender's next round resends it
    if kind in ("wrong_size", "wrong_offset", "wrong_index"):
        i = draw(st.integers(0, m - 1))
        c = me.chunks[i]
        if kind == "wrong_size":
            data = draw(st.sampled_from([bytes(c.data[:-1]), bytes(c.data) + b"\0", b""]))
            bad, name = replace(c, data=data, crc32=zlib.crc32(data)), "chunk.data"
        elif kind == "wrong_offset":
            shift = draw(st.sampled_from([1, -1, CHUNK_BYTES, 2**40]))
            bad, name = replace(c, offset=max(0, c.offset + shift) or 1), "chunk.offset"
        else:
            bad, name = replace(c, index=m + draw(st.integers(0, 2**20))), "chunk.index"
        msgs.append(_pb(bad))
        apply_prefix()
        return kind, msgs, (IA, name)
    if kind == "foreign_chunk":
        rid = draw(st.sampled_from([other.rid, f"nobody-{k}", ""]))
        msgs.append(_pb(replace(me.chunks[draw(st.integers(0, m - 1))], request_id=rid)))
        apply_prefix()
        return kind, msgs, (IA, "chunk.request_id")
    if kind == "foreign_commit":
        msgs.append(other.commit())
        apply_prefix()
        return kind, msgs, (IA, "commit.request_id")
    if kind == "bad_commit":
        tokens = draw(st.sampled_from([(), (me.first, me.first), (VOCAB + 3,), (2**32 - 1,)]))
        msgs.append(me.commit(tokens))
        apply_prefix()
        # NOTE: the first commit stands; a transfer delivered (or committed) ignores another.
        return kind, msgs, (OK, "") if me.committed else (IA, "commit.output_token_ids")
    if kind == "after_commit":
        msgs += [me.commit(), draw(st.sampled_from([_pb(me.chunks[0]), me.commit()]))]
        apply_prefix()
        me.committed = True
        return kind, msgs, (IA, msgs[-1].WhichOneof("item"))
    if kind == "two_headers":
        msgs.append(_pb(me.header))
        apply_prefix()
        return kind, msgs, (IA, "header")
    if kind == "chunk_first":
        return kind, msgs[1:] or [_pb(me.chunks[0])], (IA, "header")
    if kind == "empty":
        return kind, [], (IA, "header")
    if kind == "bad_header":
        name, header = draw(st.sampled_from(sorted(_header_faults(me, other, pre).items())))
        msgs[0] = _pb(header)
        if me.opened or me.delivered:  # a transfer in progress (a conflict) or done already
            return kind, msgs, ((IA, NF, FP), "header")
        return kind, msgs, (IA, name)
    if kind == "other_request":
        # The header of ``me``'s KV under the other live request's id: not its prompt's KV.
        msgs = [_pb(replace(me.header, request_id=other.rid))]
        return kind, msgs, ((IA, NF, FP), "header")
    msgs = [_pb(replace(me.header, request_id=f"nobody-{k}"))] + msgs[1:]
    return kind, msgs, (NF, "header.request_id")


async def _push_target(node: Node, pre: Prefilled, rid: str, salt: str) -> PushTarget:
    live = await Live(node, rid, salt, Pipeline.P_MD, N_KV).open()
    header = pre.header(rid, salt, live.cached)
    chunks = list(split(header, pre.delta(live.cached)))
    return PushTarget(live, header, chunks, pre.first)


def test_hostile_chunks_for_live_transfers_get_clear_statuses_and_harm_no_request(
    ckpt, oracle, prefilled, reference
):
    cases: dict[str, int] = {}

    async def body(node: Node, draw, k: int) -> None:
        a = await _push_target(node, prefilled, f"a{k}", f"salt-a{k}")
        b = await _push_target(node, prefilled, f"b{k}", f"salt-b{k}")
        for _ in range(draw(st.integers(2, 6))):
            me, other = draw(st.sampled_from([(a, b), (b, a)]))
            kind, msgs, expected = _hostile_push(draw, me, other, prefilled, k)
            code, details, resp = await node.push(msgs)
            _assert_status((code, details), expected, f"{kind} at {me.rid}")
            if code is OK:
                want_missing = [] if me.delivered else sorted(set(range(len(me.chunks))) - me.held)
                assert (resp.complete, list(resp.missing_chunk_indices)) == (
                    me.delivered,
                    want_missing,
                ), kind
            cases[kind] = cases.get(kind, 0) + 1
        # The real pushes, then every live request must be whole and correct.
        for t in (a, b):
            report = await node.pusher.push(
                t.header, BytesSource(prefilled.delta(t.live.cached)), [t.first]
            )
            assert report.attempts == 1
        for t in (a, b):
            start, tokens, fin = _stream_tokens(await t.live.events())
            assert start == 1 and (fin.completion_tokens, fin.md_tokens) == (N_KV, N_KV - 1)
            oracle.assert_greedy_equal(PROMPT, [t.first, *tokens], reference[:N_KV])
        assert node.receiver.inflight_bytes == 0  # nothing hostile was left held

    examples = _run_examples(ckpt, body)
    total = sum(cases.values())
    print(f"live KV pushes: {examples} examples, {total} hostile streams, by kind {cases}")
    assert examples >= EXAMPLES // 2 and total >= examples
    assert len(cases) >= len(PUSH_KINDS) // 2


# --- 2. the token handoff of a live request ------------------------------------------------------


@dataclass
class HandoffTarget:
    """A live P-RLD-MD request with its KV, being handed over; what was handed (the model)."""

    live: Live
    ref: list[int]
    handed: int = 0
    end: int | None = None

    @property
    def rid(self) -> str:
        return self.live.rid

    def batch(self, start: int, tokens, *, final: bool = False, rid: str = "", mode: int = 0):
        return md_pb.TokenHandoffRequest(
            request_id=rid or self.rid,
            start_position=start,
            token_ids=list(tokens),
            final=final,
            mode=mode,
        )


HANDOFF_KINDS = [
    "duplicate",
    "advance",
    "rewrite",
    "gap",
    "beyond_max",
    "switch",
    "no_request",
    "p_md_request",
    "out_of_vocab",
    "empty",
    "bad_mode",
]


def _hostile_handoff(draw, me: HandoffTarget, other: HandoffTarget, pmd: str, k: int):
    """One hostile handoff stream at ``me``: messages, the acks expected before its fault, and
    the expected (code, field). The model (``handed``) follows what the stream does."""
    # NOTE: after the final batch nothing advances the handoff; before it, up to K2 - 1 only.
    can_advance = me.end is None and me.handed < K2 - 1
    kinds = HANDOFF_KINDS if can_advance else [x for x in HANDOFF_KINDS if x != "advance"]
    kind = draw(st.sampled_from(kinds))
    fixed = me.handed if me.end is None else me.end  # outputs known to be the reference's
    ref = me.ref
    if kind == "duplicate":
        s = draw(st.integers(0, fixed - 1))
        e = draw(st.integers(s + 1, fixed))
        final = me.end is not None and draw(st.booleans())
        return kind, [me.batch(s, ref[s:e], final=final)], [e], (OK, "")
    if kind == "advance":
        s = draw(st.integers(0, me.handed))
        e = draw(st.integers(max(s, me.handed) + 1, K2 - 1))
        me.handed = e
        return kind, [me.batch(s, ref[s:e])], [e], (OK, "")
    if kind == "rewrite":
        s = draw(st.integers(0, fixed - 1))
        j = draw(st.integers(s, fixed - 1))
        tokens = list(ref[s : fixed + 2])
        tokens[j - s] = (tokens[j - s] + 1 + draw(st.integers(0, VOCAB - 3))) % VOCAB
        field_ = "request_id" if me.end is not None else "token_ids"
        return kind, [me.batch(s, tokens)], [], (FP, field_)
    if kind == "gap":
        s = fixed + draw(st.integers(1, 5))
        if me.end is not None:  # after the final batch: only a repeat of outputs is taken
            return kind, [me.batch(s, [(ref[s] + 1) % VOCAB])], [], (FP, "request_id")
        return kind, [me.batch(s, ref[s : s + 2])], [], (FP, "start_position")
    if kind == "beyond_max":
        s = draw(st.integers(0, fixed))
        tokens = list(ref[s:]) + [1] * draw(st.integers(1, 3))
        field_ = "request_id" if me.end is not None else "token_ids"
        return kind, [me.batch(s, tokens)], [], (FP, field_)
    if kind == "switch":
        e = draw(st.integers(1, fixed))
        msgs = [me.batch(0, ref[:e]), other.batch(0, other.ref[:1])]
        return kind, msgs, [e], (IA, "handoff[1].request_id")
    if kind == "no_request":
        return kind, [me.batch(0, ref[:2], rid=f"ghost-{k}")], [], (NF, "request_id")
    if kind == "p_md_request":
        return kind, [me.batch(0, ref[:2], rid=pmd)], [], (FP, "request_id")
    if kind == "out_of_vocab":
        tokens = list(ref[:fixed]) + [VOCAB + draw(st.integers(0, 2**31))]
        return kind, [me.batch(0, tokens)], [], (IA, f"handoff[0].token_ids[{fixed}]")
    if kind == "empty":
        return kind, [me.batch(fixed, [])], [], (IA, "handoff[0].token_ids")
    mode = draw(st.integers(3, 2**20))
    return kind, [me.batch(0, ref[:1], mode=mode)], [], (IA, "handoff[0].mode")


def test_hostile_handoffs_of_live_requests_get_clear_statuses_and_harm_no_request(
    ckpt, oracle, prefilled, reference
):
    cases: dict[str, int] = {}

    async def hostile(node: Node, draw, a, b, pmd: str, k: int) -> None:
        for _ in range(draw(st.integers(1, 3))):
            me, other = draw(st.sampled_from([(a, b), (b, a)]))
            kind, msgs, acks, expected = _hostile_handoff(draw, me, other, pmd, k)
            code, details, got = await node.handoff(msgs)
            phase = "after the final" if me.end is not None else "during"
            _assert_status((code, details), expected, f"{kind} {phase} the handoff of {me.rid}")
            assert [ack.extended_through for ack in got] == acks, kind
            cases[kind] = cases.get(kind, 0) + 1

    async def body(node: Node, draw, k: int) -> None:
        targets = []
        for name in ("a", "b"):
            rid, salt = f"h{name}{k}", f"salt-h{name}{k}"
            live = await Live(node, rid, salt, Pipeline.P_RLD_MD, N_HANDOFF).open()
            header = prefilled.header(rid, salt, live.cached)
            await node.pusher.push(
                header, BytesSource(prefilled.delta(live.cached)), [prefilled.first]
            )
            targets.append(HandoffTarget(live, reference))
        a, b = targets
        # A P-MD request that never gets its KV: a handoff must not reach it.
        pmd = await Live(node, f"pmd{k}", f"salt-pmd{k}", Pipeline.P_MD, N_KV).open()
        relays = {t.rid: node.client.token_handoff() for t in targets}
        try:
            for t in targets:  # the real relay's first catch-up round
                ack = await relays[t.rid].send(HandoffBatch(t.rid, 0, tuple(reference[:K1])))
                assert ack.extended_through == K1
                t.handed = K1
            await hostile(node, draw, a, b, pmd.rid, k)
            for t in targets:  # the real relay's final batch, from where its last round ended
                end = max(K2, t.handed)
                ack = await relays[t.rid].send(
                    HandoffBatch(t.rid, K1, tuple(reference[K1:end]), final=True)
                )
                assert ack.extended_through == end
                await relays[t.rid].done(wait=True)
                t.handed = t.end = end
                await asyncio.wait_for(t.live.speaking.wait(), 60)  # it speaks, held open
        finally:
            for call in relays.values():
                call.cancel()  # NOTE: a no-op on a finished call; never leave one open
        await hostile(node, draw, a, b, pmd.rid, k)
        for t in targets:
            start, tokens, fin = _stream_tokens(await t.live.events())
            assert start == t.end, "MainDecode speaks from the end of the real final batch"
            assert (fin.completion_tokens, fin.md_tokens) == (N_HANDOFF, N_HANDOFF - t.end)
            oracle.assert_greedy_equal(
                PROMPT + tuple(reference[: t.end]), tokens, reference[t.end :]
            )
        # (the P-MD request is cancelled with the example: the gateway's call ends)

    examples = _run_examples(ckpt, body)
    total = sum(cases.values())
    print(f"live handoffs: {examples} examples, {total} hostile streams, by kind {cases}")
    assert examples >= EXAMPLES // 2 and total >= examples
    assert len(cases) >= len(HANDOFF_KINDS) // 2
