"""The relay's request life against in-process peers: prefill's KV over the real fast link, a
real MainDecode taking the request over through an adapter with ``MainDecodeClient``'s names.

Three engines on one tiny random model, as the services run them: a prefill engine computes
the prompt and exports its KV, which reaches the relay through a ``FastLinkReceiver`` (shared
memory, written by a ``FastLinkSender``) and MainDecode through its ``KvReceiver`` (header,
chunks, commit, as a WAN push delivers them). Greedy tokens — prefill's first, the relay's,
then MainDecode's from the handoff on — must equal a single engine's (up to a near-tie, see
``tests/conftest.py``'s ``Oracle``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdd.core.errors import PeerError
from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.stage_events import (
    Accepted,
    DecodeJob,
    Finished,
    HandedOff,
    HandoffAck,
    HandoffBatch,
    KvReadiness,
    RelayJob,
)
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.kv.chunking import split
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.kv.fast_link.region import PrepareRequest
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import ShmReceiverBackend, ShmSenderBackend
from pdd.kv.fast_link.state import TransferState, Transport
from pdd.kv.receiver import KvReceiver
from pdd.kv.source import BytesSource
from pdd.kv.transfer import Commit
from pdd.server.tls import TlsConfig
from pdd.serving.channels import Channels
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.kv_bridge import export_tokens, range_header, wire_bytes
from pdd.serving.main_decode import MainDecode
from pdd.serving.model_spec import load_model
from pdd.serving.relay import Relay, RelayConfig
from tests.in_process_main_decode import (
    InProcessHandoff,
    InProcessMainDecode,
    positions,
    read_through,
)

MODEL = "tiny:3,ctx=256,layers=2,hidden=64,inter=128"
BLOCK = 4
MD_REF = InstanceRef("md-0", "in-process:0", Role.MAIN_DECODE)


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def oracle(llama_oracle, ckpt):
    return llama_oracle(ckpt)


def _engine(ckpt) -> Engine:
    return Engine(ckpt, EngineConfig(block_size=BLOCK, num_blocks=256))


class _Instance:
    """What the roles read of an ``EngineInstance``: its engine and the loop stepping it."""

    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner


class Stack:
    """Prefill's engine, a relay and a MainDecode, each on an engine of its own."""

    def __init__(self, ckpt, config: RelayConfig) -> None:
        self.prefill = _engine(ckpt)
        self.relay_engine, self.md_engine = _engine(ckpt), _engine(ckpt)
        self.relay_loop, self.md_loop = EngineLoop(self.relay_engine), EngineLoop(self.md_engine)
        self.fast = FastLinkReceiver([ShmReceiverBackend()])
        self.receiver = KvReceiver()
        self.md = MainDecode(_Instance(self.md_engine, self.md_loop), self.receiver)
        self.peer = InProcessMainDecode(self.md)
        self.relay = Relay(
            _Instance(self.relay_engine, self.relay_loop),
            self.fast,
            Channels(TlsConfig()),
            config,
            main_decode=self._main_decode,
        )
        self._kv: dict[str, tuple] = {}

    def _main_decode(self, ref: InstanceRef) -> InProcessMainDecode:
        assert ref == MD_REF, f"the relay asked for {ref}, the job named {MD_REF}"
        return self.peer

    def prefilled(self, rid: str, prompt: list[int], salt: str):
        """Prefill ``prompt`` (max_tokens=1, kept): its token-major KV and first token."""
        if rid not in self._kv:
            eng = self.prefill
            eng.add_request(
                rid, prompt, SamplingParams(max_tokens=1), salt=salt, keep_after_finish=True
            )
            (out,) = [o for o in eng.step() if o.request_id == rid]
            assert out.finished and out.position == 0
            self._kv[rid] = (export_tokens(eng, rid, 0, len(prompt)), out.token_id)
            eng.release(rid)
        return self._kv[rid]

    async def send_fast(self, rid: str, prompt: list[int], salt: str) -> None:
        """Prefill → relay over shared memory, as prefill's ``_send_fast`` does."""
        kv, first = self.prefilled(rid, prompt, salt)
        header = range_header(self.prefill, rid, 0, len(prompt), prompt, salt)
        reservation = await self.fast.prepare(
            PrepareRequest(
                rid, header.layout, header.num_tokens, header.total_bytes, (Transport.SHM,)
            )
        )
        report = await FastLinkSender([ShmSenderBackend()]).send(
            reservation,
            header,
            BytesSource(bytes(wire_bytes(kv, header.layout))),
            self.fast.complete,
            [first],
        )
        assert report.state is TransferState.COMPLETED

    async def push_wan(self, rid: str, prompt: list[int], salt: str) -> None:
        """Prefill → MainDecode: the whole prompt's KV as one push (header, chunks, commit)."""
        kv, first = self.prefilled(rid, prompt, salt)
        header = range_header(self.prefill, rid, 0, len(prompt), prompt, salt, chunk_bytes=4096)
        payload = bytes(wire_bytes(kv, header.layout))

        async def items():
            for item in (header, *split(header, payload), Commit(rid, (first,))):
                yield item

        assert (await self.receiver.receive(items())).complete

    async def __aenter__(self) -> Stack:
        await self.relay_loop.start()
        await self.md_loop.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.relay_loop.stop()
        await self.md_loop.stop()


async def _drain(events: AsyncIterator, into: list) -> None:
    async for ev in events:
        into.append(ev)


async def _open_md(stack: Stack, job: DecodeJob, events: list) -> asyncio.Task:
    """MainDecode's decode stream, read into ``events`` by a task; returns once it accepted."""
    task = asyncio.create_task(_drain(stack.md.decode(job), events))
    while not events and not task.done():
        await asyncio.sleep(0.001)
    assert isinstance(events[0], Accepted)
    return task


def _jobs(rid, prompt, n, mode, pipeline=Pipeline.P_RLD_MD, salt="s"):
    sampling = SamplingParams(max_tokens=n, ignore_eos=True)
    return (
        RelayJob(rid, tuple(prompt), sampling, salt, MD_REF, mode),
        DecodeJob(rid, tuple(prompt), sampling, salt, pipeline),
    )


def _reference(ckpt, prompt, n) -> list[int]:
    return _engine(ckpt).generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]


PROMPT = [(i * 37) % 251 + 1 for i in range(29)]


@pytest.mark.parametrize("mode", [HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP])
async def test_handoff_output_equals_a_single_engine(ckpt, oracle, mode):
    n = 120
    # NOTE: gap 0: every catch-up round that finds the relay ahead sends; at least one does.
    # At most 3 rounds: on a loaded host 8 rounds could outlast the request's 120 tokens.
    async with Stack(ckpt, RelayConfig(catch_up_gap=0, max_catch_up_rounds=3)) as stack:
        relay_job, md_job = _jobs("r1", PROMPT, n, mode)
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.send_fast("r1", PROMPT, "s")
        stream = stack.relay.decode(relay_job)
        # NOTE: MainDecode's KV arrives once the relay streamed a few tokens, as over a WAN.
        relay_events = await read_through(stream, 8)
        await stack.push_wan("r1", PROMPT, "s")
        relay_events += [ev async for ev in stream]
        await asyncio.wait_for(md_task, 30)

        assert isinstance(relay_events[0], Accepted)
        handed = relay_events[-1]
        assert isinstance(handed, HandedOff) and handed.mode is mode
        at = handed.at_position
        assert 8 < at < n, "the relay should hand over mid-stream"
        if mode is HandoffMode.CATCH_UP:
            assert handed.rounds >= 2 and len(stack.peer.batches) == handed.rounds
        else:
            assert handed.rounds == 1 and len(stack.peer.batches) == 1
        final = stack.peer.batches[-1]
        assert final.final and not final.request_finished
        assert final.start_position + len(final.token_ids) == at
        relayed, md_out = positions(relay_events), positions(md_events)
        # The relay streams its own tokens (prefill's first is not its) up to the handoff,
        # MainDecode from there on: no gap, no overlap.
        assert sorted(relayed) == list(range(1, at)) and sorted(md_out) == list(range(at, n))
        assert isinstance(md_events[-1], Finished) and md_events[-1].completion_tokens == n
        first = stack.prefilled("r1", PROMPT, "s")[1]
        tokens = [first] + [relayed[p] for p in range(1, at)] + [md_out[p] for p in range(at, n)]
        oracle.assert_greedy_equal(PROMPT, tokens, _reference(ckpt, PROMPT, n))
        # The relay freed the request's KV at once.
        assert not await stack.relay_loop.call(stack.relay_engine.holds_request, "r1")
        assert stack.peer.calls[-1].finished and not stack.peer.calls[-1].cancelled


async def test_request_finishing_on_the_relay_still_hands_its_tokens_over(ckpt, oracle):
    n = 6
    # NOTE: 22 + 6 fills 7 blocks: MainDecode computed the last output's KV too (an extension).
    prompt = PROMPT[:22]
    async with Stack(ckpt, RelayConfig()) as stack:
        relay_job, md_job = _jobs("r2", prompt, n, HandoffMode.CATCH_UP, salt="fin")
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.send_fast("r2", prompt, "fin")
        stream = stack.relay.decode(relay_job)
        # NOTE: MainDecode gets its KV only once the relay has streamed its last token: the
        # request finishes here first, and the relay waits for MainDecode to hold the KV.
        relay_events = await read_through(stream, n - 1)
        assert stack.peer.batches == []
        await stack.push_wan("r2", prompt, "fin")
        relay_events += [ev async for ev in stream]
        await asyncio.wait_for(md_task, 30)

        assert relay_events[-1] == Finished("length", n)
        assert not any(isinstance(ev, HandedOff) for ev in relay_events)
        first = stack.prefilled("r2", prompt, "fin")[1]
        relayed = positions(relay_events)
        tokens = [first] + [relayed[p] for p in range(1, n)]
        oracle.assert_greedy_equal(prompt, tokens, _reference(ckpt, prompt, n))
        (batch,) = stack.peer.batches
        assert batch.request_finished and batch.final and batch.start_position == 0
        assert list(batch.token_ids) == tokens
        # MainDecode extended every token into its DRC and emitted none of them.
        assert positions(md_events) == {} and isinstance(md_events[-1], Finished)
        held = await stack.md_loop.call(stack.md_engine.prefix_match_len, prompt + tokens, "fin")
        assert held == (len(prompt) + n) // BLOCK * BLOCK


async def test_a_main_decode_that_does_not_know_the_request_yet_is_asked_again(ckpt, oracle):
    """The gateway opens MainDecode and the relay at once and prefill does not wait for
    MainDecode: the relay may have its KV and ask for MainDecode's before MainDecode's call has
    even arrived (NOT_FOUND). Within ``main_decode_grace_s`` that is asked again, not taken as
    lost: the request is handed over as usual."""
    n = 120
    async with Stack(ckpt, RelayConfig(main_decode_grace_s=30)) as stack:
        relay_job, md_job = _jobs("r9", PROMPT, n, HandoffMode.ONE_SHOT)
        await stack.send_fast("r9", PROMPT, "s")
        stream = stack.relay.decode(relay_job)
        relay_events = await read_through(stream, 6)  # MainDecode has not heard of it yet
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.push_wan("r9", PROMPT, "s")
        relay_events += [ev async for ev in stream]
        await asyncio.wait_for(md_task, 30)
        last = relay_events[-1]
        # Handed over mid-stream, or (a fast relay) finished first and handed over as finished:
        # never taken for lost.
        assert isinstance(last, HandedOff) or last == Finished("length", n, alone=False), last
        (batch,) = stack.peer.batches
        assert batch.final and batch.request_finished is isinstance(last, Finished)
        at = last.at_position if isinstance(last, HandedOff) else n
        relayed, md_out = positions(relay_events), positions(md_events)
        first = stack.prefilled("r9", PROMPT, "s")[1]
        tokens = [first] + [relayed[p] for p in range(1, at)] + [md_out[p] for p in range(at, n)]
        oracle.assert_greedy_equal(PROMPT, tokens, _reference(ckpt, PROMPT, n))


async def test_a_failed_handoff_fails_the_relay_stream_with_the_peer_error(ckpt):
    # MainDecode decodes a P-MD request itself: it holds the KV but refuses a handoff.
    async with Stack(ckpt, RelayConfig()) as stack:
        relay_job, md_job = _jobs("r3", PROMPT, 120, HandoffMode.ONE_SHOT, pipeline=Pipeline.P_MD)
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.push_wan("r3", PROMPT, "s")
        await stack.send_fast("r3", PROMPT, "s")
        relay_events = []
        with pytest.raises(PeerError) as failed:
            async for ev in stack.relay.decode(relay_job):
                relay_events.append(ev)
        assert failed.value.code == "FAILED_PRECONDITION" and failed.value.peer == "main_decode"
        assert "only P-RLD-MD requests are handed over" in failed.value.details
        assert not any(isinstance(ev, (HandedOff, Finished)) for ev in relay_events)
        assert len(stack.peer.batches) == 1 and stack.peer.calls[-1].cancelled
        # The failed stream aborted the request: its KV is free.
        assert not await stack.relay_loop.call(stack.relay_engine.holds_request, "r3")
        md_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await md_task


async def test_a_main_decode_lost_before_its_kv_leaves_the_relay_decoding_alone(ckpt, oracle):
    """MainDecode's call ends while the relay waits for its KV: the relay decodes on, streams
    every token and finishes the request itself (no handoff), as a single engine would."""
    n = 40
    # NOTE: no grace: MainDecode not knowing the request is taken as lost at once
    async with Stack(ckpt, RelayConfig(main_decode_grace_s=0)) as stack:
        relay_job, md_job = _jobs("r4", PROMPT, n, HandoffMode.ONE_SHOT)
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.send_fast("r4", PROMPT, "s")
        stream = stack.relay.decode(relay_job)
        relay_events = await read_through(stream, 4)
        md_task.cancel()  # NOTE: MainDecode loses the request; the relay's long-poll learns it
        with contextlib.suppress(asyncio.CancelledError):
            await md_task
        relay_events += [ev async for ev in stream]
        # NOTE: ``alone``: MainDecode got no handoff (the gateway gives it one if it waits)
        assert relay_events[-1] == Finished("length", n, alone=True) and stack.peer.batches == []
        first = stack.prefilled("r4", PROMPT, "s")[1]
        relayed = positions(relay_events)
        assert sorted(relayed) == list(range(1, n))
        tokens = [first] + [relayed[p] for p in range(1, n)]
        oracle.assert_greedy_equal(PROMPT, tokens, _reference(ckpt, PROMPT, n))
        assert not await stack.relay_loop.call(stack.relay_engine.holds_request, "r4")


async def test_a_rehomed_main_decode_rebuilds_the_kv_and_continues_from_the_final_batch(
    ckpt, oracle
):
    """The gateway's re-home: a P-RLD-MD call with the tokens streamed so far prefills them
    here, says its KV is ready, decodes ahead silently, and speaks from the end of the
    gateway's final batch (the relay's tokens, taken from it): one unbroken greedy output."""
    n, k = 40, 3
    async with Stack(ckpt, RelayConfig()) as stack:
        kv_ready = stack.peer.wait_kv_ready

        async def lost_main_decode(request_id: str, timeout_ms: int) -> KvReadiness:
            await asyncio.sleep(timeout_ms / 1000)
            return KvReadiness(False, 0.0)

        # NOTE: the relay's MainDecode is the lost one the gateway re-homes from: the relay must
        # not hear that the new one has the KV, or it hands over itself, racing the gateway.
        stack.peer.wait_kv_ready = lost_main_decode
        relay_job, _ = _jobs("r5", PROMPT, n, HandoffMode.ONE_SHOT)
        await stack.send_fast("r5", PROMPT, "s")
        stream = stack.relay.decode(relay_job)
        relay_events = await read_through(stream, k - 1)
        first = stack.prefilled("r5", PROMPT, "s")[1]
        streamed = [first] + [positions(relay_events)[p] for p in range(1, k)]
        rehome = DecodeJob(
            "r5", tuple(PROMPT), relay_job.sampling, "s", Pipeline.P_RLD_MD, tuple(streamed)
        )
        md_events: list = []
        md_task = await _open_md(stack, rehome, md_events)
        readiness = await kv_ready("r5", 30_000)
        assert readiness.ready
        relay_events += await read_through(stream, k + 5)  # the relay stays the stream meanwhile
        await stream.aclose()  # NOTE: the gateway takes the request from the relay
        relayed = positions(relay_events)
        taken = [first] + [relayed[p] for p in range(1, max(relayed) + 1)]
        call = stack.peer.token_handoff()
        await call.send(HandoffBatch("r5", 0, tuple(taken), final=True))
        await asyncio.wait_for(md_task, 30)
        md_out = positions(md_events)
        assert sorted(md_out) == list(range(len(taken), n))  # nothing before the batch's end
        tokens = taken + [md_out[p] for p in range(len(taken), n)]
        oracle.assert_greedy_equal(PROMPT, tokens, _reference(ckpt, PROMPT, n))
        assert isinstance(md_events[-1], Finished) and md_events[-1].completion_tokens == n


async def test_a_request_rerouted_here_resumes_from_the_streamed_tokens_and_finishes_alone(
    ckpt, oracle
):
    """No fast-link KV: the relay prefills prompt + the tokens streamed itself, speaks from the
    next position, never polls MainDecode, and its tokens continue a single engine's output."""
    n, k = 30, 4
    ref = _reference(ckpt, PROMPT, n)
    async with Stack(ckpt, RelayConfig()) as stack:
        relay_job, _ = _jobs("r6", PROMPT, n, HandoffMode.ONE_SHOT)
        resumed = RelayJob(
            "r6",
            tuple(PROMPT),
            relay_job.sampling,
            "s",
            MD_REF,
            HandoffMode.ONE_SHOT,
            tuple(ref[:k]),
        )
        events = [ev async for ev in stack.relay.decode(resumed)]
        assert isinstance(events[0], Accepted)
        assert events[-1] == Finished("length", n, alone=True)
        relayed = positions(events)
        assert sorted(relayed) == list(range(k, n)) and stack.peer.batches == []
        tokens = list(ref[:k]) + [relayed[p] for p in range(k, n)]
        oracle.assert_greedy_equal(PROMPT, tokens, ref)
        assert not await stack.relay_loop.call(stack.relay_engine.holds_request, "r6")


@pytest.mark.parametrize("mode", [HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP])
async def test_a_client_cancelling_mid_handoff_closes_the_handoff_call(ckpt, mode):
    """The handoff's batch is on the (slow) WAN when the client goes away: the relay's handoff
    call must be cancelled, or MainDecode's TokenHandoff handler and the relay's call task live
    on forever (one per such request: what `pdd bench soak` found as a growing task count)."""
    wan_stalled = asyncio.Event()

    class _StalledHandoff(InProcessHandoff):
        async def send(self, batch: HandoffBatch) -> HandoffAck:
            self.peer.batches.append(batch)
            wan_stalled.set()
            await asyncio.Event().wait()  # NOTE: never answered

    async with Stack(ckpt, RelayConfig()) as stack:
        stack.peer.token_handoff = lambda: (
            stack.peer.calls.append(_StalledHandoff(stack.peer)) or stack.peer.calls[-1]
        )
        rid = f"cancel-{mode.value}"
        relay_job, md_job = _jobs(rid, PROMPT, 120, mode)
        md_events: list = []
        md_task = await _open_md(stack, md_job, md_events)
        await stack.push_wan(rid, PROMPT, "s")
        await stack.send_fast(rid, PROMPT, "s")
        stream = stack.relay.decode(relay_job)
        reader = asyncio.create_task(_drain(stream, []))
        await asyncio.wait_for(wan_stalled.wait(), 30)
        reader.cancel()  # NOTE: the client's cancellation reaches the relay's stream like this
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await stream.aclose()
        for _ in range(100):
            if stack.peer.calls[-1].cancelled:
                break
            await asyncio.sleep(0.01)
        assert stack.peer.calls[-1].cancelled, "the handoff call was left open"
        assert not await stack.relay_loop.call(stack.relay_engine.holds_request, rid)
        md_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await md_task
