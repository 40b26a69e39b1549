"""The relay role on vLLM: prefill (vLLM) → relay (vLLM) over the fast link, → MainDecode (vLLM).

Three in-process vLLM engines, each role on its own engine loop as the services run them:
prefill computes the prompt and exports its KV, which reaches the relay through a
``FastLinkReceiver`` (shared memory, written by a ``FastLinkSender``) and MainDecode through its
``KvReceiver`` (header, chunks, commit, as a WAN push delivers them). The relay decodes at once
and hands the request over by token IDs (one-shot, or catch-up over several batches) to a real
``MainDecode`` behind an adapter with ``MainDecodeClient``'s names. Greedy tokens — prefill's
first, the relay's, then MainDecode's from the handoff on — must equal vLLM's own ``generate``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import (
    Accepted,
    DecodeJob,
    Finished,
    HandedOff,
    RelayJob,
)
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
from pdd.serving.relay import Relay, RelayConfig
from tests.in_process_main_decode import InProcessMainDecode, positions, read_through

MD_REF = InstanceRef("md-0", "in-process:0", Role.MAIN_DECODE)


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 29 + i * 11 + (i * i) % 17) % 500 for i in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class _Instance:
    def __init__(self, engine, runner) -> None:
        self.engine, self.runner = engine, runner


def _computed(prefill, rid: str, prompt: list[int]) -> tuple:
    """Prefill ``prompt`` on vLLM (one output, KV kept): token-major KV and the first token."""
    prefill.add_request(rid, prompt, _greedy(1), keep_after_finish=True)
    outs = []
    while prefill.has_schedulable():
        outs += [o for o in prefill.step() if o.request_id == rid]
    (first,) = outs
    kv = export_tokens(prefill, rid, 0, len(prompt))
    header = range_header(prefill, rid, 0, len(prompt), prompt, "", chunk_bytes=1 << 16)
    prefill.release(rid)
    return kv, header, first.token_id


async def _send_fast(fast: FastLinkReceiver, rid: str, kv, header, first: int) -> None:
    """Prefill → relay over shared memory, as prefill's ``_send_fast`` does."""
    layout = header.layout
    reservation = await fast.prepare(
        PrepareRequest(rid, layout, header.num_tokens, header.total_bytes, (Transport.SHM,))
    )
    report = await FastLinkSender([ShmSenderBackend()]).send(
        reservation, header, BytesSource(bytes(wire_bytes(kv, layout))), fast.complete, [first]
    )
    assert report.state is TransferState.COMPLETED


async def _push_wan(receiver: KvReceiver, rid: str, kv, header, first: int) -> None:
    """Prefill → MainDecode: the whole prompt's KV as one push (header, chunks, commit)."""
    chunks = list(split(header, bytes(wire_bytes(kv, header.layout))))
    assert len(chunks) > 1  # a multi-block prompt in several chunks

    async def items():
        for item in (header, *chunks, Commit(rid, (first,))):
            yield item

    assert (await receiver.receive(items())).complete


async def _drain(events: AsyncIterator, into: list) -> None:
    async for ev in events:
        into.append(ev)


@pytest.mark.parametrize(("mode", "seed"), [(HandoffMode.ONE_SHOT, 21), (HandoffMode.CATCH_UP, 22)])
async def test_p_rld_md_on_vllm_equals_vllm_alone(prefill, relay, md, mode, seed):
    # NOTE: room for the catch-up's rounds: with 64 the relay once finished first on a busy host
    n, rid = 128, f"rld-{mode.value}"
    prompt = _prompt(seed, 300)  # three 128-token blocks, the last one partial
    (alone,) = prefill.generate([prompt], _greedy(n))
    kv, header, first = _computed(prefill, rid, prompt)
    assert first == alone[0]

    relay_loop, md_loop = EngineLoop(relay), EngineLoop(md)
    await relay_loop.start()
    await md_loop.start()
    try:
        receiver, fast = KvReceiver(), FastLinkReceiver([ShmReceiverBackend()])
        peer = InProcessMainDecode(MainDecode(_Instance(md, md_loop), receiver, kv_timeout_s=60))
        role = Relay(
            _Instance(relay, relay_loop),
            fast,
            Channels(TlsConfig()),
            RelayConfig(catch_up_gap=0, max_catch_up_rounds=3),
            main_decode=lambda ref: peer,
        )
        sampling = _greedy(n)
        md_events: list = []
        md_task = asyncio.create_task(
            _drain(
                peer.md.decode(DecodeJob(rid, tuple(prompt), sampling, "", Pipeline.P_RLD_MD)),
                md_events,
            )
        )
        while not md_events:
            await asyncio.sleep(0.001)
        assert md_events[0] == Accepted(0)
        await _send_fast(fast, rid, kv, header, first)
        stream = role.decode(RelayJob(rid, tuple(prompt), sampling, "", MD_REF, mode))
        # NOTE: MainDecode's KV arrives once the relay streamed a few tokens, as over a WAN.
        relay_events = await read_through(stream, 8)
        await _push_wan(receiver, rid, kv, header, first)
        relay_events += [ev async for ev in stream]
        await asyncio.wait_for(md_task, 120)

        assert isinstance(relay_events[0], Accepted)
        handed = relay_events[-1]
        assert isinstance(handed, HandedOff) and handed.mode is mode
        at = handed.at_position
        assert 8 < at < n, "the relay should hand over mid-stream"
        if mode is HandoffMode.CATCH_UP:
            assert handed.rounds >= 2 and len(peer.batches) == handed.rounds
        else:
            assert handed.rounds == 1 and len(peer.batches) == 1
        final = peer.batches[-1]
        assert final.final and final.start_position + len(final.token_ids) == at
        relayed, md_out = positions(relay_events), positions(md_events)
        assert sorted(relayed) == list(range(1, at)) and sorted(md_out) == list(range(at, n))
        assert isinstance(md_events[-1], Finished) and md_events[-1].completion_tokens == n
        tokens = [first] + [relayed[p] for p in range(1, at)] + [md_out[p] for p in range(at, n)]
        assert tokens == alone
        # Afterwards neither holds the request: the relay freed it at the handoff, MainDecode
        # at its end (its prompt + outputs stay only in vLLM's prefix cache).
        await asyncio.sleep(0.05)  # NOTE: the relay's abort is queued, not awaited
        for eng, loop in ((relay, relay_loop), (md, md_loop)):
            assert not await loop.call(eng.holds_request, rid)
            assert not await loop.call(eng.has_schedulable)
        assert await relay_loop.call(relay.request_counts) == (0, 0, 0)
        assert peer.calls[-1].finished and not peer.calls[-1].cancelled
    finally:
        await relay_loop.stop()
        await md_loop.stop()
