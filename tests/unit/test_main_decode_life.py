"""MainDecode's request life against in-process peers: the KV arrives through its real
``KvReceiver``, exported by a second engine (prefill's) on the same tiny random model; handoff
batches are handed to ``MainDecode.handoff`` as the relay's typed client would.

Every stream is compared with a single engine's greedy output for the same prompt (and, after a
rollback, for the prompt followed by the tokens the relay decided), up to a near-tie (see
``tests/conftest.py``'s ``Oracle``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import pytest

from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import Accepted, DecodeJob, Finished, HandoffBatch, Tokens
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.kv.chunking import split
from pdd.kv.receiver import KvReceiver
from pdd.kv.transfer import Commit
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.kv_bridge import export_tokens, range_header, wire_bytes
from pdd.serving.main_decode import MainDecode
from pdd.serving.model_spec import load_model

MODEL = "tiny:3,ctx=256,layers=2,hidden=64,inter=128"
BLOCK = 4
SALT = "tenant-a"
PROMPT = [1 + (i * 7) % 250 for i in range(22)]


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def oracle(llama_oracle, ckpt):
    return llama_oracle(ckpt)


def _engine(ckpt) -> Engine:
    return Engine(ckpt, EngineConfig(block_size=BLOCK, num_blocks=256))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _single(ckpt, prompt: Sequence[int], n: int) -> list[int]:
    """A single engine's greedy outputs: what the whole pipeline must produce."""
    return _engine(ckpt).generate([list(prompt)], _greedy(n))[0]


class _Instance:
    """What MainDecode reads of an ``EngineInstance``: its engine and the loop stepping it."""

    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner


class Node:
    """A MainDecode on its own engine, and prefill's engine that exports the KV it receives."""

    def __init__(self, ckpt) -> None:
        self.prefill = _engine(ckpt)
        self.engine = _engine(ckpt)
        self.loop = EngineLoop(self.engine)
        self.receiver = KvReceiver()
        self.md = MainDecode(_Instance(self.engine, self.loop), self.receiver, kv_timeout_s=30)

    async def push(self, rid: str, prompt: Sequence[int], start: int) -> int:
        """Prefill ``prompt`` and push tokens ``[start, n)`` of its KV as a WAN push delivers
        them (header, chunks in reverse order, commit); prefill's first token."""
        eng = self.prefill
        eng.add_request(rid, list(prompt), _greedy(1), salt=SALT, keep_after_finish=True)
        while not (outs := [o for o in eng.step() if o.request_id == rid]):
            pass
        (first,) = outs
        kv = export_tokens(eng, rid, start, len(prompt))  # [n - start, L, 2, KV, D]
        eng.release(rid)
        header = range_header(eng, rid, start, len(prompt), prompt, SALT, chunk_bytes=2048)
        chunks = list(split(header, bytes(wire_bytes(kv, header.layout))))
        assert len(chunks) > 1

        async def items():
            for item in (header, *reversed(chunks), Commit(rid, (first.token_id,))):
                yield item

        assert (await self.receiver.receive(items())).complete
        return first.token_id

    async def outputs(self, rid: str) -> list[int]:
        """The engine's outputs of ``rid`` now (read on the engine thread)."""
        return await self.loop.call(self.engine.output_token_ids, rid)

    async def __aenter__(self) -> Node:
        await self.loop.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.loop.stop()


async def _rest(stream: AsyncIterator) -> list:
    return [ev async for ev in stream]


def _tokens(events: list) -> tuple[int, list[int]]:
    """The first position streamed and the tokens, checking they are contiguous."""
    tokens = [ev for ev in events if isinstance(ev, Tokens)]
    assert tokens, f"no tokens in {events}"
    out: list[int] = []
    for ev in tokens:
        assert ev.start_position == tokens[0].start_position + len(out), events
        out += ev.token_ids
    return tokens[0].start_position, out


async def test_p_md_request_decodes_from_prefills_first_token(ckpt, oracle):
    n = 12
    async with Node(ckpt) as node:
        job = DecodeJob("r1", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)  # nothing cached: the whole prompt is pushed
        first = await node.push("r1", PROMPT, 0)
        events = await asyncio.wait_for(_rest(stream), 60)
        start, tokens = _tokens(events)
        assert start == 1  # position 0 is prefill's; MainDecode speaks from the next one
        fin = events[-1]
        assert isinstance(fin, Finished)
        assert (fin.finish_reason, fin.completion_tokens, fin.md_tokens) == ("length", n, n - 1)
        assert fin.wan_kv_bytes > 0
        oracle.assert_greedy_equal(PROMPT, [first, *tokens], _single(ckpt, PROMPT, n))
        assert not node.engine.holds_request("r1") and node.receiver.pop("r1") is None


async def test_handoff_rolls_back_what_main_decode_decoded_ahead(ckpt, oracle):
    """Two batches (catch-up): the second disagrees with what MainDecode decoded meanwhile;
    MainDecode drops its own path and continues from the relay's tokens."""
    # NOTE: long enough that MainDecode, decoding ahead on its own thread, is still at it when
    # the second batch lands (a finished request cannot roll back: FAILED_PRECONDITION).
    n = 200
    ref = _single(ckpt, PROMPT, n)
    # The relay sampled another token at output 6 than MainDecode will (greedy: ``ref``'s).
    x = next(t for t in range(1, 250) if t != ref[6])
    decided = [*ref[:6], x]
    after = _single(ckpt, PROMPT + decided, n - len(decided))
    assert after != ref[len(decided) :]  # else a missed rollback would go unnoticed
    async with Node(ckpt) as node:
        job = DecodeJob("r2", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_RLD_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        await node.push("r2", PROMPT, 0)
        rest = asyncio.create_task(_rest(stream))
        ack = await node.md.handoff(HandoffBatch("r2", 0, tuple(ref[:4])))
        assert ack.extended_through == 4
        # MainDecode decodes ahead of the relay between rounds.
        while len(ahead := await node.outputs("r2")) < 8:
            await asyncio.sleep(0.005)
        assert not rest.done()  # it speaks only after the final batch
        assert ahead[6] == ref[6] != x
        ack = await node.md.handoff(HandoffBatch("r2", 4, tuple(decided[4:]), final=True))
        assert ack.extended_through == 7 and ack.computed_through >= 7
        events = await asyncio.wait_for(rest, 60)
        start, tokens = _tokens(events)
        assert start == 7
        assert events[-1].completion_tokens == n and events[-1].md_tokens == n - 7
        oracle.assert_greedy_equal(PROMPT + decided, tokens, after)


async def test_a_request_finished_upstream_is_extended_into_the_drc(ckpt, oracle):
    n = 8
    ref = _single(ckpt, PROMPT, n)
    async with Node(ckpt) as node:
        job = DecodeJob("r3", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_RLD_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        rest = asyncio.create_task(_rest(stream))  # NOTE: the stream is read on, as a servicer does
        await node.push("r3", PROMPT, 0)
        ack = await node.md.handoff(
            HandoffBatch("r3", 0, tuple(ref), final=True, request_finished=True)
        )
        assert ack.extended_through == n
        events = await asyncio.wait_for(rest, 60)
        assert [type(ev) for ev in events] == [Finished]  # it emits nothing of its own
        assert (events[0].completion_tokens, events[0].md_tokens) == (n, 0)

        # The DRC holds prompt + output (full blocks): the session's next turn hits here.
        convo = PROMPT + ref
        cached = len(convo) // BLOCK * BLOCK
        assert await node.loop.call(node.engine.prefix_match_len, convo, SALT) == cached
        turn = [*convo, 17, 18, 19, 20, 21]
        stream = node.md.decode(DecodeJob("r4", tuple(turn), _greedy(6), SALT, Pipeline.P_MD))
        assert await anext(stream) == Accepted(cached)
        first = await node.push("r4", turn, cached)  # only the delta crosses
        _, tokens = _tokens(await asyncio.wait_for(_rest(stream), 60))
        oracle.assert_greedy_equal(turn, [first, *tokens], _single(ckpt, turn, 6))


@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_request_ended_early_is_aborted_and_its_kv_freed(ckpt, how):
    async with Node(ckpt) as node:
        job = DecodeJob("r5", tuple(PROMPT), _greedy(8), SALT, Pipeline.P_RLD_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        assert node.engine.holds_request("r5")
        if how == "closed":  # the gateway's call ended between two events
            await stream.aclose()
        else:  # ... or while MainDecode waits for its KV
            task = asyncio.create_task(anext(stream))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await node.loop.call(lambda: None)  # the abort was queued on the engine thread
        assert not node.engine.holds_request("r5")
        assert node.engine.kv_usage()[0] == 0
        # A push arriving late finds no waiter; the next request of that id starts afresh.
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        await stream.aclose()


RESUME_SAMPLINGS = {
    "greedy": _greedy(16),
    "seeded": SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=1234),
    "penalties": SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        temperature=0.8,
        top_p=0.9,
        seed=99,
        presence_penalty=0.7,
        frequency_penalty=0.5,
    ),
}


@pytest.mark.parametrize("kind", list(RESUME_SAMPLINGS))
async def test_a_resumed_request_continues_a_single_engines_output(ckpt, oracle, kind):
    """A request migrated here with the outputs already streamed: MainDecode prefills prompt +
    those locally and speaks from the next position, drawing what one engine would have drawn
    (draws depend on seed and position; penalties follow the appended outputs)."""
    sampling = RESUME_SAMPLINGS[kind]
    n = sampling.max_tokens
    ref = _engine(ckpt).generate([list(PROMPT)], sampling)[0]
    assert len(ref) == n
    if kind != "greedy":  # else a resume that ignored the seed or the penalties would pass
        plain = replace(sampling, presence_penalty=0.0, frequency_penalty=0.0)
        if kind == "seeded":
            plain = _greedy(n)
        assert _engine(ckpt).generate([list(PROMPT)], plain)[0] != ref
    async with Node(ckpt) as node:
        for k in (1, 6, 13):
            rid = f"resume-{kind}-{k}"
            job = DecodeJob(rid, tuple(PROMPT), sampling, SALT, Pipeline.MD, tuple(ref[:k]))
            stream = node.md.decode(job)
            assert isinstance(await anext(stream), Accepted)
            events = await asyncio.wait_for(_rest(stream), 60)
            start, tokens = _tokens(events)
            assert start == k  # nothing it was given is streamed again
            fin = events[-1]
            assert isinstance(fin, Finished)
            assert (fin.finish_reason, fin.completion_tokens, fin.md_tokens) == ("length", n, n - k)
            if sampling.greedy:
                oracle.assert_greedy_equal(PROMPT + ref[:k], tokens, ref[k:])
            else:
                assert tokens == ref[k:], f"resumed at {k}"
            assert not node.engine.holds_request(rid)


def test_a_resume_is_validated_where_the_job_is_made():
    from pdd.core.errors import InvalidArgumentError
    from pdd.wire import main_decode as conv

    job = DecodeJob("r", tuple(PROMPT), _greedy(4), SALT, Pipeline.MD, (5, 6))
    assert conv.job_from_pb(conv.job_to_pb(job), vocab=256) == job
    hinted = DecodeJob("r", tuple(PROMPT), _greedy(4), SALT, Pipeline.MD, burst_following=7)
    assert conv.job_from_pb(conv.job_to_pb(hinted), vocab=256) == hinted
    with pytest.raises(InvalidArgumentError, match=r"resume_token_ids\[1\]: token id 300"):
        conv.job_from_pb(
            conv.job_to_pb(DecodeJob("r", (1,), _greedy(4), "", Pipeline.MD, (5, 300))), 256
        )
    with pytest.raises(InvalidArgumentError, match="resume_token_ids: only with pipeline MD"):
        DecodeJob("r", (1,), _greedy(4), "", Pipeline.P_MD, (5,))
    with pytest.raises(InvalidArgumentError, match="resume_token_ids: 4 outputs leave nothing"):
        DecodeJob("r", (1,), _greedy(4), "", Pipeline.MD, (5, 6, 7, 8))


async def test_tokens_queued_while_the_stream_is_behind_go_out_in_one_message(ckpt, oracle):
    """A reader slower than the engine's steps: what piled up meanwhile is one ``Tokens``."""
    n = 40
    async with Node(ckpt) as node:
        job = DecodeJob("r1", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        first = await node.push("r1", PROMPT, 0)
        # The reader's first read: on a quiet machine one token, on a loaded one a few the
        # engine made before the reader woke; either way fewer than all of them.
        head = await asyncio.wait_for(anext(stream), 60)
        assert isinstance(head, Tokens) and head.start_position == 1
        k = len(head.token_ids)
        assert 1 <= k < n - 1, k

        def done() -> bool:  # finished: released, or kept with every output
            eng = node.engine
            return not eng.holds_request("r1") or len(eng.output_token_ids("r1")) >= n

        for _ in range(600):  # the reader stalls while the engine decodes the rest
            if await node.loop.call(done):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # NOTE: margin for the loop to route the last step's output
        rest = await asyncio.wait_for(_rest(stream), 60)
        assert [type(ev) for ev in rest] == [Tokens, Finished], rest
        assert rest[0].start_position == 1 + k and len(rest[0].token_ids) == n - 1 - k
        tokens = [first, *head.token_ids, *rest[0].token_ids]
        oracle.assert_greedy_equal(PROMPT, tokens, _single(ckpt, PROMPT, n))
        assert rest[1].md_tokens == n - 1


async def test_duplicated_out_of_order_and_foreign_batches_get_clear_answers(ckpt, oracle):
    """Hostile or replayed handoff batches: one ahead of what MainDecode holds is refused naming
    ``start_position``; a duplicated batch is acknowledged again and changes nothing; a batch
    for a P-MD request or for no request is refused; the relay's real batches then still give
    a single engine's output."""
    from pdd.core.errors import FailedPreconditionError, NotFoundError

    n = 40
    ref = _single(ckpt, PROMPT, n)
    async with Node(ckpt) as node:
        job = DecodeJob("r5", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_RLD_MD)
        stream = node.md.decode(job)
        assert await anext(stream) == Accepted(0)
        await node.push("r5", PROMPT, 0)
        rest = asyncio.create_task(_rest(stream))
        # Out of order: the second batch before the first (MainDecode holds no output yet).
        with pytest.raises(FailedPreconditionError, match="start_position"):
            await node.md.handoff(HandoffBatch("r5", 4, tuple(ref[4:8])))
        first = await node.md.handoff(HandoffBatch("r5", 0, tuple(ref[:4])))
        again = await node.md.handoff(HandoffBatch("r5", 0, tuple(ref[:4])))
        assert first.extended_through == again.extended_through == 4
        pmd = DecodeJob("r6", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_MD)
        other = node.md.decode(pmd)
        assert isinstance(await anext(other), Accepted)  # (r5's prompt: a DRC hit)
        with pytest.raises(FailedPreconditionError, match="only P-RLD-MD requests"):
            await node.md.handoff(HandoffBatch("r6", 0, tuple(ref[:4])))
        await other.aclose()
        with pytest.raises(NotFoundError, match="request_id"):
            await node.md.handoff(HandoffBatch("nobody", 0, (1, 2)))
        ack = await node.md.handoff(HandoffBatch("r5", 4, tuple(ref[4:8]), final=True))
        assert ack.extended_through == 8
        events = await asyncio.wait_for(rest, 60)
        start, tokens = _tokens(events)
        assert start == 8 and events[-1].completion_tokens == n
        oracle.assert_greedy_equal(PROMPT + ref[:8], tokens, ref[8:])


async def test_p_md_imports_the_kv_and_appends_the_first_token_in_one_engine_call(ckpt, oracle):
    """Each engine call waits for the step in progress: a P-MD request whose KV lands while
    MainDecode is stepping others pays that wait once, not once for the import and again for
    its first token."""
    n = 6
    async with Node(ckpt) as node:
        calls: list[str] = []
        real_call = node.loop.call

        async def counted(fn, *args, **kwargs):
            calls.append(fn.__qualname__)
            return await real_call(fn, *args, **kwargs)

        node.loop.call = counted
        stream = node.md.decode(DecodeJob("r1", tuple(PROMPT), _greedy(n), SALT, Pipeline.P_MD))
        assert await anext(stream) == Accepted(0)
        first = await node.push("r1", PROMPT, 0)
        events = await asyncio.wait_for(_rest(stream), 60)
        _, tokens = _tokens(events)
        assert events[-1].wan_kv_bytes > 0
        oracle.assert_greedy_equal(PROMPT, [first, *tokens], _single(ckpt, PROMPT, n))
        assert calls == ["MainDecode._admit.<locals>.admit", "MainDecode._append.<locals>.run"]
