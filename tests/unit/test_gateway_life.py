"""The gateway's request life against in-process peers (no gRPC): the thing under test is
``Gateway.generate`` — routing, opening the stage streams, the merge, the takeover when the relay
dies, the gap check, cancellation. The peers are fakes with the typed clients' methods that play
back scripted domain events (``FakeStream``), so every assertion is about what the gateway did
with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from pdd.core.errors import FailedPreconditionError, PeerError
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline, Stage
from pdd.core.request import FinalEvent, GenerateJob, TokenEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.core.stage_events import (
    FAST_LINK_FAILED,
    Accepted,
    DecodeJob,
    Finished,
    FirstToken,
    HandedOff,
    HandoffAck,
    HandoffBatch,
    KvReadiness,
    Tokens,
    TransferDone,
)
from pdd.prefix_index.store import Hit
from pdd.serving.gateway import Gateway
from pdd.wire.gateway import stats_to_pb

PREFILL = Instance(InstanceRef("p0", "127.0.0.1:7001", Role.PREFILL), 4)
RELAY = Instance(InstanceRef("r0", "127.0.0.1:7002", Role.RELAY), 4)
MAIN_DECODE = Instance(InstanceRef("m0", "127.0.0.1:7003", Role.MAIN_DECODE, "remote"), 4)
MAIN_DECODE_1 = Instance(InstanceRef("m1", "127.0.0.1:7004", Role.MAIN_DECODE, "remote"), 4)
MAIN_DECODE_2 = Instance(InstanceRef("m2", "127.0.0.1:7005", Role.MAIN_DECODE, "remote"), 4)
PROMPT = tuple(range(1, 9))

HOLD = object()  # script item: the stream stays open (no event) until it is cancelled
TURN = object()  # script item: the read takes one turn of the event loop (a busy gateway's read)


class Signal:
    """Script item: set ``event`` and go on (lets one stream wait for another's progress)."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event


class FakeStream:
    """An ``EventStream`` stand-in. Script items: a domain event (returned by ``read``), an
    ``asyncio.Event`` (wait for it), a ``Signal``, an exception (raised by ``read``), ``HOLD``,
    ``TURN``.
    Cancelled, a pending or later ``read`` raises CANCELLED, as a cancelled gRPC call does."""

    def __init__(self, peer: str, script: list) -> None:
        self.peer = peer
        self.script = list(script)
        self.cancelled = False
        self.first_read = asyncio.Event()
        self._cancel = asyncio.Event()

    async def read(self):
        self.first_read.set()
        while True:
            if self.cancelled:
                raise PeerError("CANCELLED", "cancelled", self.peer)
            if not self.script:
                return None
            item = self.script.pop(0)
            if item is HOLD:
                self.script.insert(0, HOLD)
                await self._until(self._cancel)
            elif item is TURN:
                await asyncio.sleep(0)
            elif isinstance(item, asyncio.Event):
                await self._until(item)
            elif isinstance(item, Signal):
                item.event.set()
            elif isinstance(item, BaseException):
                raise item
            else:
                return item

    async def _until(self, gate: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(gate.wait()), asyncio.ensure_future(self._cancel.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self._cancel.set()


class FakeHandoff:
    """A ``HandoffCall`` stand-in: records each batch and ``done``; sets ``handed`` on a final
    batch (MainDecode's fake stream waits for it)."""

    def __init__(self, handed: asyncio.Event) -> None:
        self.batches: list[HandoffBatch] = []
        self.done_wait: bool | None = None
        self.cancelled = False
        self._handed = handed

    async def send(self, batch: HandoffBatch) -> HandoffAck:
        self.batches.append(batch)
        end = batch.start_position + len(batch.token_ids)
        if batch.final:
            self._handed.set()
        return HandoffAck(extended_through=end, computed_through=end)

    async def done(self, *, wait: bool = False) -> None:
        self.done_wait = wait

    def cancel(self) -> None:
        self.cancelled = True


def waits_for_bind(script: list, bound: asyncio.Event) -> list:
    """A prefill script as prefill runs it when opened without MainDecode's hit: nothing after
    its first token (its TransferDone) before the gateway's bind (the script's own signals
    right after the token go first); one without a first token (a refusal) waits for nothing."""
    at = next((i + 1 for i, item in enumerate(script) if isinstance(item, FirstToken)), 0)
    if not at:
        return list(script)
    while at and at < len(script) and isinstance(script[at], Signal):
        at += 1
    return [*script[:at], bound, *script[at:]]


class FakeKvstore:
    def __init__(self, hits: list[Hit]) -> None:
        self.hits = hits

    async def list(self, role=None) -> list[Instance]:
        return [h.instance for h in self.hits]

    async def predict(self, prompt, salt: str = "", *, block_sizes=()) -> list[Hit]:
        return self.hits


class FakePeers:
    """Every peer of one request: the streams each stage call returns, and what was asked.
    ``later``: by MainDecode address, the scripts of the decode calls after the first (a
    migrated request's; the address's instance is then listed by kvstore too)."""

    def __init__(
        self,
        md: list,
        prefill: list | None = None,
        relay: list | None = None,
        later: dict[Instance, list[list]] | None = None,
    ) -> None:
        self.md = FakeStream("main_decode", md)
        self.later = {
            i.ref.address: [FakeStream(i.ref.instance_id, sc) for sc in scripts]
            for i, scripts in (later or {}).items()
        }
        self.resumed: list[tuple[str, DecodeJob]] = []  # (address, job) of the later calls
        self.prefill_script = list(prefill or [])
        self.prefill_stream = FakeStream("prefill", self.prefill_script)
        self.prefill_jobs: list[object] = []  # every prefill call's job, in order
        self.relay_stream = FakeStream("relay", relay or [])
        self.handed = asyncio.Event()  # MainDecode got the gateway's final handoff batch
        self.handoff = FakeHandoff(self.handed)
        self.jobs: dict[str, object] = {}
        # Per prefill call: whether the relay's Accepted was read first (P-RLD-MD; else True).
        self.relay_accepted_before_prefill: list[bool] = []
        self.binds: list[tuple[str, int]] = []  # prefill told MainDecode's hit (rid, tokens)
        self.bound = asyncio.Event()
        self.kv = FakeKvstore([Hit(i, 0, 0.0) for i in (PREFILL, RELAY, MAIN_DECODE)])
        # the first MainDecode holds part of the prompt: the router picks it first
        self.kv.hits[2] = Hit(MAIN_DECODE, 4, 0.5)
        self.kv.hits += [Hit(i, 0, 0.0) for i in later or {} if i != MAIN_DECODE]
        self.closed = False
        # By MainDecode address: set once it holds a re-homed request's KV; who polled it.
        self.ready: dict[str, asyncio.Event] = {}
        self.polled: list[str] = []

    def kvstore(self) -> FakeKvstore:
        return self.kv

    def prefill(self, address: str):
        assert address == PREFILL.ref.address
        peers = self

        class Client:
            def prefill(self, job):
                peers.jobs["prefill"] = job
                peers.prefill_jobs.append(job)
                if peers.prefill_stream.cancelled:  # a request started over: its script again
                    peers.prefill_stream = FakeStream("prefill", peers.prefill_script)
                if job.main_decode_cached_tokens is None:
                    peers.bound = asyncio.Event()
                    stream = peers.prefill_stream
                    stream.script = waits_for_bind(stream.script, peers.bound)
                # the relay (beside prefill) has accepted by now; MainDecode's answer is not
                # waited for: its hit is bound later
                peers.relay_accepted_before_prefill.append(
                    job.pipeline is not Pipeline.P_RLD_MD or peers.relay_stream.first_read.is_set()
                )
                return peers.prefill_stream

            async def bind_main_decode(self, request_id, cached_tokens):
                peers.binds.append((request_id, cached_tokens))
                peers.bound.set()

        return Client()

    def relay(self, address: str):
        assert address == RELAY.ref.address
        peers = self

        class Client:
            def decode(self, job):
                peers.jobs["relay"] = job
                return peers.relay_stream

        return Client()

    def main_decode(self, address: str):
        assert address == MAIN_DECODE.ref.address or address in self.later
        peers = self

        class Client:
            def decode(self, job):
                if "main_decode" in peers.jobs:
                    peers.resumed.append((address, job))
                    return peers.later[address].pop(0)
                assert address == MAIN_DECODE.ref.address
                peers.jobs["main_decode"] = job
                return peers.md

            def token_handoff(self):
                return peers.handoff

            async def wait_kv_ready(self, request_id, timeout_ms):
                peers.polled.append(address)
                ready = peers.ready.setdefault(address, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), timeout_ms / 1000)
                return KvReadiness(ready.is_set(), 0.0)

        return Client()

    async def close(self) -> None:
        self.closed = True


def job(pipeline: Pipeline, **sampling) -> GenerateJob:
    return GenerateJob(
        "req-1",
        PROMPT,
        SamplingParams(max_tokens=8, **sampling),
        force_pipeline=pipeline,
        handoff_mode=HandoffMode.ONE_SHOT if pipeline is Pipeline.P_RLD_MD else None,
    )


async def run(
    peers: FakePeers, request: GenerateJob, **config
) -> tuple[list[TokenEvent], FinalEvent]:
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers, **config)
    events = [ev async for ev in gateway.generate(request)]
    await gateway.close()
    assert peers.closed
    *tokens, final = events
    assert isinstance(final, FinalEvent) and all(isinstance(t, TokenEvent) for t in tokens)
    return tokens, final


def flat(tokens: list[TokenEvent]) -> tuple[list[int], list[Stage]]:
    ids = [t for ev in tokens for t in ev.token_ids]
    stages = [ev.stage for ev in tokens for _ in ev.token_ids]
    positions = [ev.start_position for ev in tokens]
    assert positions == [sum(len(e.token_ids) for e in tokens[:i]) for i in range(len(tokens))]
    return ids, stages


def first_token(token_id: int = 20, logprob: Logprob | None = None) -> FirstToken:
    return FirstToken(token_id, len(PROMPT), 0, 1.0, logprob)


TRANSFER = TransferDone(0, 4096, 0.0, 2.5, 0.0, "")


async def test_p_md_merges_prefills_first_token_with_main_decodes_tokens():
    peers = FakePeers(
        # MainDecode's tokens may come before prefill's first one: they wait in the merge
        md=[Accepted(3), Tokens(1, (21, 22)), Tokens(3, (23,)), Finished("length", 4, 3)],
        prefill=[first_token(), TRANSFER],
    )
    tokens, final = await run(peers, job(Pipeline.P_MD, temperature=0.8))
    assert flat(tokens) == ([20, 21, 22, 23], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 3)
    s = final.stats
    assert final.finish_reason == "length" and s.pipeline is Pipeline.P_MD
    assert (s.completion_tokens, s.md_tokens, s.rld_tokens) == (4, 3, 0)
    assert (s.md_cached_tokens, s.wan_kv_bytes, s.wan_transfer_ms) == (3, 4096, 2.5)
    assert (s.prefill_instance, s.main_decode_instance, s.relay_instance) == ("p0", "m0", "")
    assert s.ttft_ms > 0 and s.e2e_ms >= s.ttft_ms
    # prefill pushes MainDecode's missing KV from where MainDecode said its hit ends
    p, md = peers.jobs["prefill"], peers.jobs["main_decode"]
    assert p.main_decode_cached_tokens is None and p.relay is None and p.pipeline is Pipeline.P_MD
    assert p.main_decode == MAIN_DECODE.ref and peers.binds == [("req-1", 3)]
    # a sampled request without a seed: the gateway picks one, the same for every stage
    assert md.sampling.seed is not None and p.sampling.seed == md.sampling.seed
    assert "relay" not in peers.jobs and not peers.handoff.batches


async def test_each_stage_call_says_how_many_requests_are_still_routing_behind_it():
    """``burst_following``: the requests between admission and their stage calls besides this
    one (two more here, held in routing), counted out exactly once when the calls are open."""
    peers = FakePeers(
        md=[Accepted(3), Tokens(1, (21,)), Finished("length", 2, 1)],
        prefill=[first_token(), TRANSFER],
    )
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers)
    gateway.routing_now = 2  # two other requests waiting for kvstore's answer
    request = replace(job(Pipeline.P_MD), sampling=SamplingParams(max_tokens=2))
    events = [ev async for ev in gateway.generate(request)]
    assert isinstance(events[-1], FinalEvent)
    assert peers.jobs["main_decode"].burst_following == 2
    assert peers.jobs["prefill"].burst_following == 2
    assert gateway.routing_now == 2  # this request's own count is gone, once

    class Down(FakeKvstore):
        async def predict(self, prompt, salt: str = "", *, block_sizes=()) -> list[Hit]:
            raise RuntimeError("kvstore fell over mid-answer")

    peers.kv = Down(peers.kv.hits)
    with pytest.raises(RuntimeError):
        async for _ in gateway.generate(request):
            pass
    assert gateway.routing_now == 2  # a request that never routed is counted out too
    await gateway.close()


@pytest.mark.parametrize("first_token_last", [False, True], ids=["streamed", "buffered"])
async def test_p_rld_md_drops_what_both_relay_and_main_decode_sent(first_token_last):
    """The overlap arrives once the relay's copy was streamed, or while both wait in the merge
    behind a late first token: either way the first copy of a position is the one kept."""
    relay_handed_off = asyncio.Event()
    relay_reading = asyncio.Event()
    md_sent = asyncio.Event()
    prefill = [md_sent] if first_token_last else []
    peers = FakePeers(
        # MainDecode accepts only once the relay's stream is being read too: the gateway must
        # not wait for MainDecode's answer before the relay's, or this request never starts
        md=[
            relay_reading,
            Accepted(0),
            relay_handed_off,
            Tokens(2, (22, 23, 24, 25)),
            Signal(md_sent),
            Finished("stop", 6, 4),
        ],
        prefill=[*prefill, first_token(), TRANSFER],
        relay=[
            Signal(relay_reading),
            Accepted(),
            Tokens(1, (21, 22, 23)),
            HandedOff(3, HandoffMode.ONE_SHOT, 1, 1.5),
            Signal(relay_handed_off),
        ],
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    ids, stages = flat(tokens)
    assert ids == [20, 21, 22, 23, 24, 25]  # positions 2 and 3 came twice: each kept once
    assert stages == [Stage.PREFILL] + [Stage.RELAY] * 3 + [Stage.MAIN_DECODE] * 2
    s = final.stats
    assert final.finish_reason == "stop" and s.pipeline is Pipeline.P_RLD_MD
    assert (s.completion_tokens, s.rld_tokens, s.md_tokens, s.handoff_at_token) == (6, 3, 2, 3)
    assert s.relay_instance == "r0" and peers.relay_accepted_before_prefill == [True]
    assert peers.binds == [("req-1", 0)]
    r = peers.jobs["relay"]
    assert r.main_decode == MAIN_DECODE.ref and r.handoff_mode is HandoffMode.ONE_SHOT
    assert peers.jobs["prefill"].relay == RELAY.ref
    assert not peers.handoff.batches  # the relay handed over itself


def handoffs_by_gateway() -> float:
    labels = {"mode": "one-shot", "kind": "gateway"}
    return REGISTRY.get_sample_value("pdd_handoffs_total", labels) or 0.0


async def test_a_relay_lost_mid_stream_is_handed_to_main_decode_by_the_gateway():
    first_sent = asyncio.Event()
    peers = FakePeers(md=[Accepted(0)], prefill=[first_token(), Signal(first_sent), TRANSFER])
    # MainDecode goes on from what the gateway handed it, and only once it was handed
    peers.md.script += [peers.handed, Tokens(3, (23, 24)), Finished("length", 5, 2)]
    peers.relay_stream.script = [
        Accepted(),
        first_sent,
        Tokens(1, (21, 22)),
        PeerError("UNAVAILABLE", "connection reset by peer", "relay"),
    ]
    before = handoffs_by_gateway()
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert peers.handoff.batches == [
        HandoffBatch("req-1", 0, (20, 21, 22), final=True, mode=HandoffMode.ONE_SHOT)
    ]
    assert peers.handoff.done_wait is True
    assert flat(tokens) == (
        [20, 21, 22, 23, 24],
        [Stage.PREFILL, Stage.RELAY, Stage.RELAY, Stage.MAIN_DECODE, Stage.MAIN_DECODE],
    )
    assert final.finish_reason == "length" and final.stats.handoff_at_token == 3
    assert handoffs_by_gateway() == before + 1


async def test_a_relay_failing_after_its_handoff_fails_the_request():
    """Only a relay lost before it handed over is taken over; after, its error is the request's."""
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), HandedOff(1, HandoffMode.ONE_SHOT, 1, 1.0), PeerError("INTERNAL", "x")],
    )
    with pytest.raises(PeerError, match="x"):
        await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert not peers.handoff.batches and peers.md.cancelled


async def test_a_gap_in_the_merged_stream_fails_the_request():
    peers = FakePeers(
        md=[Accepted(0), Tokens(2, (22,)), Finished("length", 3, 1)],
        prefill=[first_token(), TRANSFER],
    )
    with pytest.raises(FailedPreconditionError, match="gap: delivered 1 of 3 tokens"):
        await run(peers, job(Pipeline.P_MD))


async def test_a_stage_short_of_the_logprobs_asked_for_fails_the_request():
    lp = Logprob(-0.5)
    peers = FakePeers(
        md=[Accepted(0), Tokens(1, (21, 22), (lp,)), Finished("length", 3, 2)],
        prefill=[first_token(logprob=lp), TRANSFER],
    )
    with pytest.raises(FailedPreconditionError, match="main_decode sent 1 logprobs for 2 tokens"):
        await run(peers, job(Pipeline.P_MD, logprobs=0))
    peers = FakePeers(md=[Accepted(0), HOLD], prefill=[first_token(), TRANSFER])
    with pytest.raises(FailedPreconditionError, match="prefill sent its token without"):
        await run(peers, job(Pipeline.P_MD, logprobs=0))


def requests(outcome: str) -> float:
    labels = {"pipeline": "p-rld-md", "outcome": outcome}
    return REGISTRY.get_sample_value("pdd_requests_total", labels) or 0.0


async def test_a_client_going_away_cancels_every_stage_call():
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        prefill=[first_token(), HOLD],
        relay=[Accepted(), Tokens(1, (21,)), HOLD],
    )
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers)
    before = requests("cancelled")
    got: list[int] = []
    async with contextlib.aclosing(gateway.generate(job(Pipeline.P_RLD_MD))) as events:
        async for ev in events:
            got.extend(ev.token_ids)
            if len(got) == 2:
                break
        streams = (peers.md, peers.prefill_stream, peers.relay_stream)
        assert not any(s.cancelled for s in streams)  # the stream is open until the client goes
    assert got == [20, 21]
    assert all(s.cancelled for s in streams)
    assert requests("cancelled") == before + 1
    for _ in range(5):  # the readers' tasks end once cancelled
        await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


# --- migration: MainDecode or prefill lost mid-request ------------------------------------------


def migrations(cause: str) -> float:
    return REGISTRY.get_sample_value("pdd_migrations_total", {"cause": cause}) or 0.0


def lost(name: str) -> PeerError:
    return PeerError("UNAVAILABLE", f"{name}: connection reset by peer", name)


async def test_a_main_decode_lost_mid_stream_is_resumed_on_another_from_the_tokens_streamed():
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(3), first_sent, Tokens(1, (21, 22)), lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
        later={MAIN_DECODE_1: [[Accepted(0), Tokens(3, (23, 24)), Finished("length", 5, 2)]]},
    )
    before = migrations("main_decode_lost")
    request = job(Pipeline.P_MD, temperature=0.8)
    tokens, final = await asyncio.wait_for(run(peers, request), 10)
    assert flat(tokens) == ([20, 21, 22, 23, 24], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 4)
    seeded = peers.jobs["main_decode"].sampling
    assert peers.resumed == [
        (
            MAIN_DECODE_1.ref.address,
            DecodeJob("req-1", PROMPT, seeded, "", Pipeline.MD, resume_token_ids=(20, 21, 22)),
        )
    ]
    assert seeded.seed is not None  # the same draws on the new MainDecode
    assert final.finish_reason == "length" and final.stats.completion_tokens == 5
    assert final.stats.main_decode_instance == "m1" and peers.prefill_stream.cancelled
    assert migrations("main_decode_lost") == before + 1
    assert final.stats.migrations == 1 and stats_to_pb(final.stats).migrations == 1


async def test_a_prefill_lost_before_its_first_token_resumes_as_md_with_nothing_streamed():
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        prefill=[lost("p0")],
        # the same MainDecode may take the request again, now prefilling it itself
        later={MAIN_DECODE: [[Accepted(0), Tokens(0, (20, 21, 22)), Finished("length", 3, 3)]]},
    )
    before = migrations("prefill_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert flat(tokens) == ([20, 21, 22], [Stage.MAIN_DECODE] * 3)
    ((address, resumed),) = peers.resumed
    assert address == MAIN_DECODE.ref.address and peers.md.cancelled  # the old call is gone
    assert (resumed.pipeline, resumed.resume_token_ids) == (Pipeline.MD, ())
    assert final.finish_reason == "length" and final.stats.completion_tokens == 3
    assert migrations("prefill_lost") == before + 1


async def test_a_main_decode_lost_while_the_relay_streams_is_rehomed_and_takes_over_when_ready():
    """The relay keeps decoding (alone) while another MainDecode rebuilds the KV from the
    tokens streamed; once that one holds it, the gateway stops the relay and hands over."""
    md_lost, rebuilt = asyncio.Event(), asyncio.Event()
    peers = FakePeers(
        # NOTE: Signal then the error in one read: MainDecode's loss is queued before the relay goes on
        md=[Accepted(0), Signal(md_lost), lost("m0")],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), Tokens(1, (21,)), md_lost, Tokens(2, (22,)), Tokens(3, (23,))]
        + [Signal(rebuilt), HOLD],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},
    )
    m1 = MAIN_DECODE_1.ref.address
    peers.ready[m1] = rebuilt  # it holds the KV once the relay has streamed through 23
    # after the gateway's final batch, m1 speaks from its end
    peers.later[m1][0].script = [
        Accepted(0),
        peers.handed,
        Tokens(4, (24,)),
        Finished("length", 5, 1),
    ]
    before = migrations("main_decode_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    ids, stages = flat(tokens)
    assert ids == [20, 21, 22, 23, 24]
    assert stages == [Stage.PREFILL] + [Stage.RELAY] * 3 + [Stage.MAIN_DECODE]
    ((address, rehomed),) = peers.resumed
    # rebuilt from what was streamed when m0 was lost: the relay's first token and prefill's
    assert address == m1 and rehomed.pipeline is Pipeline.P_RLD_MD
    assert rehomed.resume_token_ids in ((20,), (20, 21))
    assert m1 in peers.polled and peers.relay_stream.cancelled
    (batch,) = peers.handoff.batches
    assert (batch.start_position, batch.token_ids, batch.final) == (0, (20, 21, 22, 23), True)
    s = final.stats
    assert (s.main_decode_instance, s.migrations, s.handoff_at_token) == ("m1", 1, 4)
    assert migrations("main_decode_lost") == before + 1


async def test_with_no_other_main_decode_the_relay_finishes_the_request_alone():
    md_lost = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), Signal(md_lost), lost("m0")],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), Tokens(1, (21,)), md_lost, Tokens(2, (22, 23)), Finished("length", 4)],
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 22, 23] and not peers.resumed
    assert final.finish_reason == "length" and final.stats.rld_tokens == 3
    assert not peers.handoff.batches


async def test_a_relay_finishing_before_the_rehomed_main_decode_is_ready_stops_it():
    md_lost = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), Signal(md_lost), lost("m0")],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), Tokens(1, (21,)), md_lost, Tokens(2, (22, 23)), Finished("length", 4)],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},  # never ready
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 22, 23] and final.finish_reason == "length"
    ((address, _),) = peers.resumed
    assert peers.later[address] == [] and not peers.handoff.batches
    assert final.stats.main_decode_instance == "m1"


async def test_a_prefill_lost_while_the_relay_streams_rehomes_away_from_the_relays_target():
    """MainDecode m0 will never get its push: the request is rebuilt on m1 (never on m0 itself,
    which the relay may still be polling), and the relay stays the stream meanwhile."""
    relay_spoke, rebuilt = asyncio.Event(), asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        prefill=[first_token(), relay_spoke, lost("p0")],
        relay=[Accepted(), Tokens(1, (21,)), Signal(relay_spoke), Tokens(2, (22,))]
        + [Signal(rebuilt), HOLD],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},
    )
    m1 = MAIN_DECODE_1.ref.address
    peers.ready[m1] = rebuilt
    peers.later[m1][0].script = [
        Accepted(0),
        peers.handed,
        Tokens(3, (23,)),
        Finished("length", 4, 1),
    ]
    before = migrations("prefill_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 22, 23]
    ((address, rehomed),) = peers.resumed
    assert address == m1 and rehomed.pipeline is Pipeline.P_RLD_MD
    assert peers.md.cancelled  # m0 waited for a push that could not come
    assert peers.handoff.batches[-1].token_ids == (20, 21, 22)
    assert migrations("prefill_lost") == before + 1


async def test_migrations_stop_at_the_limit_with_the_lost_stages_error():
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), first_sent, lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
        later={
            MAIN_DECODE_1: [[Accepted(0), Tokens(1, (21,)), lost("m1")]],
            MAIN_DECODE_2: [[Accepted(0), Tokens(1, (21,)), lost("m2")]],
        },
    )
    with pytest.raises(PeerError, match="connection reset") as err:
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD), max_migrations=1), 10)
    # one migration (to m1 or m2), then that one's loss fails the request: no second move
    ((address, resumed),) = peers.resumed
    name = {MAIN_DECODE_1.ref.address: "m1", MAIN_DECODE_2.ref.address: "m2"}[address]
    assert err.value.code == "UNAVAILABLE" and f"{name}: connection reset" in str(err.value)
    assert resumed.resume_token_ids == (20,)


async def test_with_no_other_main_decode_the_loss_fails_the_request():
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), first_sent, Tokens(1, (21,)), lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
    )
    with pytest.raises(PeerError, match="m0: connection reset") as err:
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert err.value.code == "UNAVAILABLE" and not peers.resumed


async def test_a_relay_that_finished_alone_hands_main_decode_the_tokens_as_finished():
    """The relay took MainDecode for lost and finished the request without a handoff
    (``Finished.alone``), but MainDecode is alive and waits for one: the gateway hands it every
    token as a finished request (its DRC keeps them) instead of leaving the call open until the
    stage deadline, though the client has every token."""
    peers = FakePeers(
        md=[],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), Tokens(1, (21, 22, 23)), Finished("length", 4, alone=True)],
    )
    peers.md.script = [Accepted(0), peers.handed, Finished("length", 4, 0)]
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens) == ([20, 21, 22, 23], [Stage.PREFILL] + [Stage.RELAY] * 3)
    assert final.finish_reason == "length" and final.stats.rld_tokens == 3
    (batch,) = peers.handoff.batches
    assert batch.final and batch.request_finished and batch.token_ids == (20, 21, 22, 23)


# --- a stage failing before it accepts the request ---------------------------------------------


@pytest.mark.parametrize(
    ("pipeline", "refusal"),
    [
        (Pipeline.P_MD, lost("m0")),
        (Pipeline.P_MD, None),  # the stream closes without an Accepted
        (Pipeline.P_RLD_MD, lost("m0")),
    ],
    ids=["p-md-error", "p-md-closed", "p-rld-md-error"],
)
async def test_a_main_decode_failing_before_it_accepts_is_migrated_like_a_later_loss(
    pipeline, refusal
):
    """Prefill, opened beside MainDecode, sent its first token before the loss was read: the
    request moves from it, nothing of it streamed before the new MainDecode accepted."""
    peers = FakePeers(
        md=[refusal] if refusal else [],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), HOLD],
        later={MAIN_DECODE_1: [[Accepted(0), Tokens(1, (21, 22)), Finished("length", 3, 2)]]},
    )
    before = migrations("main_decode_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(pipeline, temperature=0.8)), 10)
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 2)
    # another MainDecode (m0 excluded) prefills the request itself, from the token streamed
    ((address, resumed),) = peers.resumed
    assert address == MAIN_DECODE_1.ref.address and peers.prefill_stream.cancelled
    assert (resumed.pipeline, resumed.resume_token_ids) == (Pipeline.MD, (20,))
    assert resumed.sampling == peers.jobs["main_decode"].sampling  # the seed drawn once
    assert pipeline is Pipeline.P_MD or peers.relay_stream.cancelled
    assert final.stats.main_decode_instance == "m1" and final.stats.migrations == 1
    assert migrations("main_decode_lost") == before + 1


async def test_a_main_decode_failing_before_it_accepts_counts_against_the_limit():
    peers = FakePeers(
        md=[lost("m0")],
        later={MAIN_DECODE_1: [[Accepted(0), Tokens(0, (20,)), Finished("length", 1, 1)]]},
    )
    with pytest.raises(PeerError, match="m0: connection reset"):
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD), max_migrations=0), 10)
    assert not peers.resumed and peers.prefill_stream.cancelled


async def test_a_relay_failing_before_it_accepts_falls_back_to_p_md_on_the_same_main_decode():
    peers = FakePeers(
        md=[Accepted(4), HOLD],
        prefill=[first_token(), TRANSFER],
        relay=[lost("r0")],
        # MainDecode's call is reopened as P-MD: it starts from prefill's first token
        later={MAIN_DECODE: [[Accepted(3), Tokens(1, (21, 22)), Finished("length", 3, 2)]]},
    )
    before = migrations("main_decode_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 2)
    ((address, reopened),) = peers.resumed
    assert address == MAIN_DECODE.ref.address and peers.md.cancelled
    assert (reopened.pipeline, reopened.resume_token_ids) == (Pipeline.P_MD, ())
    p = peers.jobs["prefill"]
    assert (p.pipeline, p.relay, p.main_decode_cached_tokens) == (Pipeline.P_MD, None, None)
    assert peers.binds == [("req-1", 3)]  # the reopened MainDecode's hit
    s = final.stats
    assert (s.pipeline, s.handoff_mode, s.relay_instance) == (Pipeline.P_MD, None, "")
    assert s.md_cached_tokens == 3 and s.main_decode_instance == "m0" and s.migrations == 0
    assert migrations("main_decode_lost") == before  # no MainDecode was lost
    assert not peers.handoff.batches


async def test_a_relay_and_then_main_decode_failing_before_accepting_moves_to_another():
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        relay=[lost("r0")],
        later={
            MAIN_DECODE: [[lost("m0")]],  # the P-MD reopening fails too: m0 is lost
            MAIN_DECODE_1: [[Accepted(0), Tokens(0, (20, 21)), Finished("length", 2, 2)]],
        },
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21]
    assert [a for a, _ in peers.resumed] == [MAIN_DECODE.ref.address, MAIN_DECODE_1.ref.address]
    assert peers.resumed[1][1].pipeline is Pipeline.MD and peers.prefill_stream.cancelled
    assert final.stats.main_decode_instance == "m1" and final.stats.migrations == 1


# --- MainDecode lost once the client has every token --------------------------------------------

ALL = (21, 22, 23, 24, 25, 26, 27)  # after prefill's first token: max_tokens (8) in all


@pytest.mark.parametrize(
    ("after_first", "sampling", "config", "reason"),
    [
        (ALL, {"ignore_eos": True}, {}, "length"),
        (ALL, {}, {"eos_token_ids": (2,)}, "length"),  # the last token is no eos id
        ((21, 30), {"stop_token_ids": (30,)}, {}, "stop"),
        ((21, 2), {}, {"eos_token_ids": (2,)}, "stop"),
        # a stop token at max_tokens: "stop", as the engine says (it checks stops first)
        ((*ALL[:-1], 30), {"stop_token_ids": (30,), "ignore_eos": True}, {}, "stop"),
    ],
    ids=["length-ignore-eos", "length-eos-known", "stop-token", "eos", "stop-at-max"],
)
async def test_a_main_decode_lost_after_the_last_token_finishes_the_request_at_the_gateway(
    after_first, sampling, config, reason
):
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), first_sent, Tokens(1, after_first), lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},  # there is a MainDecode to move to
    )
    request = job(Pipeline.P_MD, temperature=0.8, **sampling)
    tokens, final = await asyncio.wait_for(run(peers, request, **config), 10)
    assert flat(tokens)[0] == [20, *after_first]
    assert final.finish_reason == reason and not peers.resumed
    assert final.stats.completion_tokens == 1 + len(after_first) and final.stats.migrations == 0


async def test_a_main_decode_lost_after_the_relay_finished_the_request_does_not_fail_it():
    relay_finished = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), relay_finished, lost("m0")],
        prefill=[first_token(), TRANSFER],
        relay=[Accepted(), Tokens(1, (21, 22)), Finished("stop", 3, 2), Signal(relay_finished)],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 22]
    assert final.finish_reason == "stop" and not peers.resumed
    assert final.stats.completion_tokens == 3


async def test_a_stop_only_main_decode_can_tell_is_left_to_the_main_decode_resumed():
    """The last token may end the request (an eos id the gateway was not told, a grammar
    complete): the request moves with every token streamed and the new MainDecode says."""
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), first_sent, Tokens(1, (21, 2)), lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
        later={MAIN_DECODE_1: [[Accepted(0), Finished("stop", 3, 0)]]},
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 2]
    ((_, resumed),) = peers.resumed
    assert resumed.resume_token_ids == (20, 21, 2)
    assert final.finish_reason == "stop" and final.stats.migrations == 1


async def test_a_main_decode_lost_at_max_tokens_with_the_eos_ids_unknown_fails_the_request():
    """The last token may be an eos id (then the engine says "stop", else "length"): the
    gateway does not guess, and a resume with nothing left to decode is no request."""
    first_sent = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), first_sent, Tokens(1, ALL), lost("m0")],
        prefill=[first_token(), Signal(first_sent), TRANSFER],
        later={MAIN_DECODE_1: [[Accepted(0), HOLD]]},
    )
    with pytest.raises(PeerError, match="m0: connection reset"):
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert not peers.resumed


async def test_rehome_targets_refusing_one_after_another_leave_the_relay_to_finish():
    """Re-homing never blocks the relay's stream: each refusal comes back as a failed stream,
    the next MainDecode is tried, and with none left the relay finishes the request."""
    md_lost, m1_tried, m2_tried = asyncio.Event(), asyncio.Event(), asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), Signal(md_lost), lost("m0")],
        prefill=[first_token(), TRANSFER],
        # NOTE: the relay goes on only once both targets were tried (in either order)
        relay=[Accepted(), Tokens(1, (21,)), md_lost, Tokens(2, (22,)), m1_tried, m2_tried]
        + [Tokens(3, (23,)), Finished("length", 4)],
        later={
            MAIN_DECODE_1: [[Signal(m1_tried), lost("m1")]],
            MAIN_DECODE_2: [[Signal(m2_tried), lost("m2")]],
        },
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21, 22, 23] and final.finish_reason == "length"
    assert sorted(a for a, _ in peers.resumed) == sorted(
        [MAIN_DECODE_1.ref.address, MAIN_DECODE_2.ref.address]
    )
    assert final.stats.migrations == 2 and not peers.handoff.batches


async def test_a_p_md_request_past_its_kv_deadline_is_rerouted_through_the_relay():
    """MainDecode never speaks (its WAN is partitioned): at the deadline the relay takes the
    request from what was streamed (it prefills prompt + those itself) and finishes it."""
    peers = FakePeers(
        md=[Accepted(0), HOLD],
        prefill=[first_token(), HOLD],  # its push cannot cross either
        relay=[Accepted(), Tokens(1, (21, 22)), Tokens(3, (23,)), Finished("length", 4)],
    )
    before = migrations("kv_deadline")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD), kv_deadline_s=0.2), 10)
    ids, stages = flat(tokens)
    assert ids == [20, 21, 22, 23] and stages == [Stage.PREFILL] + [Stage.RELAY] * 3
    relay_job = peers.jobs["relay"]
    assert relay_job.resume_token_ids == (20,) and relay_job.main_decode == MAIN_DECODE.ref
    assert peers.md.cancelled and peers.prefill_stream.cancelled
    s = final.stats
    assert (s.relay_instance, s.migrations, s.rld_tokens) == ("r0", 1, 3)
    assert final.finish_reason == "length" and migrations("kv_deadline") == before + 1


async def test_a_p_md_request_whose_main_decode_speaks_in_time_is_not_rerouted():
    """MainDecode spoke before the deadline, then paused past it: it holds the KV; no re-route."""
    resume = asyncio.Event()
    peers = FakePeers(
        md=[Accepted(0), Tokens(1, (21,)), resume, Tokens(2, (22,)), Finished("length", 3, 2)],
        prefill=[first_token(), TRANSFER],
    )
    asyncio.get_running_loop().call_later(0.3, resume.set)
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD), kv_deadline_s=0.05), 10)
    assert flat(tokens)[0] == [20, 21, 22] and "relay" not in peers.jobs
    assert final.stats.migrations == 0


async def test_tokens_queued_while_the_client_is_behind_go_out_as_one_event():
    """A client slower than MainDecode's stream: what piled up meanwhile is one event, with its
    logprobs joined in order; a client that keeps up gets each token as it came."""
    lp = [Logprob(-0.1 * i, ()) for i in range(8)]
    md_tokens = [Tokens(p, (20 + p,), (lp[p],)) for p in range(1, 8)]
    peers = FakePeers(
        md=[Accepted(0), *md_tokens, Finished("length", 8, 7)],
        prefill=[first_token(logprob=lp[0]), TRANSFER],
    )
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers)
    stream = gateway.generate(job(Pipeline.P_MD, logprobs=0))
    head = await anext(stream)
    assert (head.start_position, head.token_ids, head.stage) == (0, (20,), Stage.PREFILL)
    for _ in range(100):  # the client stalls until MainDecode has sent everything
        if not peers.md.script:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # NOTE: margin for the reader task to queue the last event
    *rest, final = [ev async for ev in stream]
    await gateway.close()
    assert len(rest) == 1 and isinstance(final, FinalEvent), rest
    assert (rest[0].start_position, rest[0].token_ids) == (1, tuple(range(21, 28)))
    assert rest[0].stage is Stage.MAIN_DECODE and rest[0].logprobs == tuple(lp[1:])
    assert final.stats.completion_tokens == 8 and final.stats.md_tokens == 7


async def test_a_stream_that_keeps_up_gets_each_token_as_it_came():
    """MainDecode's tokens 30 ms apart (an engine's steps): each goes out alone, none waits."""
    gates = [asyncio.Event() for _ in range(4)]
    peers = FakePeers(
        md=[Accepted(0), *[x for p in range(1, 5) for x in (gates[p - 1], Tokens(p, (20 + p,)))]]
        + [Finished("length", 5, 4)],
        prefill=[first_token(), TRANSFER],
    )
    for i, gate in enumerate(gates):
        asyncio.get_running_loop().call_later(0.03 * (i + 1), gate.set)
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert [ev.token_ids for ev in tokens] == [(20,), (21,), (22,), (23,), (24,)]
    assert final.stats.completion_tokens == 5


async def test_tokens_read_in_consecutive_turns_share_one_write():
    """A saturated gateway: each read of MainDecode's stream takes one turn of the event loop.
    The stream waits one turn before it writes, so the next read's token joins the write instead
    of paying a message of its own (the whole of ``pdd bench gateway``'s gain at one token a
    message); every token still arrives once, in order."""
    peers = FakePeers(
        md=[Accepted(0), *[x for p in range(1, 9) for x in (TURN, Tokens(p, (20 + p,)))]]
        + [Finished("length", 9, 8)],
        prefill=[first_token(), TRANSFER],
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert flat(tokens)[0] == list(range(20, 29))
    assert len(tokens) <= 5, [ev.token_ids for ev in tokens]
    assert final.stats.completion_tokens == 9


@pytest.mark.parametrize(("hold_s", "longest"), [(0.0, 4), (60.0, 400)])
async def test_a_token_waits_for_the_next_ones_no_longer_than_the_hold(
    monkeypatch, hold_s, longest
):
    """A producer that never pauses (a token every turn, 400 of them): with no hold each write
    still goes out after one turn, a few tokens at a time; with a hold longer than the stream
    they all wait for each other and leave as one or two writes. The hold (``JOIN_HOLD_S``,
    2 ms) is what bounds a token's wait on a saturated gateway."""
    import pdd.serving.gateway as gateway_module

    monkeypatch.setattr(gateway_module, "JOIN_HOLD_S", hold_s)
    n = 400
    peers = FakePeers(
        md=[Accepted(0), *[x for p in range(1, n) for x in (TURN, Tokens(p, (p,)))]]
        + [Finished("length", n, n - 1)],
        prefill=[first_token(0), TRANSFER],
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 30)
    assert flat(tokens)[0] == list(range(n)) and final.stats.completion_tokens == n
    sizes = [len(ev.token_ids) for ev in tokens]
    if longest < n:
        assert max(sizes) <= longest, sizes
    else:
        assert len(tokens) <= 3, sizes


async def test_the_gateway_exports_its_in_flight_bound():
    """``pdd_gateway_in_flight_limit`` is the adaptive bound now, or ``--max-in-flight`` alone."""
    from prometheus_client import REGISTRY

    def exported() -> float | None:
        return REGISTRY.get_sample_value("pdd_gateway_in_flight_limit")

    fixed = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=FakePeers([]), max_in_flight=77)
    assert exported() == 77
    await fixed.close()
    adaptive = Gateway(
        "127.0.0.1:7000", rng=random.Random(7), peers=FakePeers([]), adaptive_in_flight=True
    )
    assert adaptive.limiter is not None and exported() == adaptive.limiter.limit == 32
    for _ in range(64):  # level latency, the bound in use: it grows
        adaptive.limiter.sample(0.1, 30, adaptive.limiter.round)
    grown = adaptive.limiter.limit
    assert exported() == grown > 32
    adaptive.limiter.refused()  # overloaded: the baseline stops learning
    for _ in range(64):  # latency quadrupled: the bound falls
        adaptive.limiter.sample(0.4, 30, adaptive.limiter.round)
    assert exported() == adaptive.limiter.limit < grown
    await adaptive.close()


async def test_a_relay_the_fast_link_never_reached_is_handed_over_at_once():
    """Prefill says the KV never made it onto the relay's fast link (the relay alive but not
    reached, e.g. just restarted): the relay would wait for it until the client's deadline, so
    the gateway stops it and hands MainDecode, which got its delta over the WAN, the first token."""
    peers = FakePeers(
        md=[Accepted(0)],
        prefill=[first_token(), TransferDone(0, 4096, 0.0, 2.5, 0.0, FAST_LINK_FAILED)],
        relay=[Accepted(), HOLD],  # never gets its KV: nothing from it
    )
    peers.md.script += [peers.handed, Tokens(1, (21, 22)), Finished("length", 3, 2)]
    before = handoffs_by_gateway()
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert peers.relay_stream.cancelled
    assert peers.handoff.batches == [
        HandoffBatch("req-1", 0, (20,), final=True, mode=HandoffMode.ONE_SHOT)
    ]
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL, Stage.MAIN_DECODE, Stage.MAIN_DECODE])
    assert final.finish_reason == "length" and final.stats.handoff_at_token == 1
    assert handoffs_by_gateway() == before + 1
