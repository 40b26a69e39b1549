"""PDD's engine boundary over vLLM (``pdd.engine_vllm``), on vLLM's CPU build.

"vLLM alone" is ``VllmEngine.generate`` on a fresh prompt: vLLM computing everything itself.
Each path below must give the same greedy tokens: KV computed by one engine (vLLM or ours),
moved in PDD's canonical format through our connector, and decoded by the other; an extension
(catch-up) that rolls back what vLLM decoded ahead; a second turn that imports only the delta.
"""

from __future__ import annotations

import asyncio

import torch

from pdd.core.block_hash import chain_hashes
from pdd.core.pipeline import Pipeline
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import Accepted, DecodeJob, Finished, HandoffBatch, Tokens
from pdd.engine.kv_wire import KvPayload
from pdd.engine.protocol import EngineBackend
from pdd.kv.chunking import split
from pdd.kv.receiver import KvReceiver
from pdd.kv.transfer import Commit
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.kv_bridge import export_tokens, range_header, wire_bytes
from pdd.serving.main_decode import MainDecode


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 31 + i * 7 + (i * i) % 13) % 500 for i in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _run(eng: EngineBackend, rid: str) -> list:
    outs = []
    while eng.has_schedulable():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def _prefill(eng: EngineBackend, rid: str, prompt: list[int]):
    """Compute ``prompt`` (one output, KV kept): the first token and the KV payload."""
    eng.add_request(rid, prompt, _greedy(1), keep_after_finish=True)
    (first,) = _run(eng, rid)
    payload = eng.export_kv(rid, 0, len(prompt))
    eng.release(rid)
    return first.token_id, payload


def _decode_imported(eng: EngineBackend, rid: str, prompt, payload, first: int, n: int) -> list:
    """MainDecode's P-MD path on the engine: admit paused, import, append the first token, run."""
    eng.add_request(rid, prompt, _greedy(n), paused=True)
    eng.import_kv(rid, payload)
    eng.append_tokens(rid, [first], 0)
    eng.resume(rid)
    return [first] + [o.token_id for o in _run(eng, rid)]


def test_vllm_engine_is_an_engine_backend(md, ours):
    assert isinstance(md, EngineBackend) and isinstance(ours, EngineBackend)
    assert md.block_size == 128  # the CPU build's block: prompts below span several


def test_vllm_kv_equals_our_engines_kv_for_the_same_weights(prefill, ours):
    prompt = _prompt(1, 300)
    first_v, theirs = _prefill(prefill, "kv-v", prompt)
    first_o, mine = _prefill(ours, "kv-o", prompt)
    assert first_v == first_o
    assert theirs.descriptor.num_tokens == 300 and theirs.descriptor.block_size == 128
    torch.testing.assert_close(theirs.to_tensor(), mine.to_tensor(), rtol=1e-4, atol=1e-4)


def test_p_md_on_vllm_equals_vllm_alone(md, prefill, ours):
    prompt, n = _prompt(2, 333), 24
    first, payload = _prefill(prefill, "pmd-p", prompt)
    got = _decode_imported(md, "pmd", prompt, payload, first, n)
    alone = prefill.generate([_prompt(2, 333)], _greedy(n))[0]
    assert got == alone
    assert ours.generate([prompt], _greedy(n))[0] == alone  # and our engine agrees


def test_mixed_engines_equal_vllm_alone(md, prefill, ours):
    """Our prefill → vLLM MainDecode, and vLLM prefill → our MainDecode."""
    n = 20
    prompt = _prompt(3, 290)
    first, payload = _prefill(ours, "mix-o", prompt)
    assert payload.descriptor.block_size == 16  # ours: another block size than vLLM's 128
    got = _decode_imported(md, "mix-1", prompt, payload, first, n)
    prompt2 = _prompt(4, 270)
    first2, payload2 = _prefill(prefill, "mix-v", prompt2)
    got2 = _decode_imported(ours, "mix-2", prompt2, payload2, first2, n)
    assert got == prefill.generate([prompt], _greedy(n))[0]
    assert got2 == prefill.generate([prompt2], _greedy(n))[0]


def test_catch_up_rolls_back_what_vllm_decoded_ahead(md, prefill):
    prompt, n = _prompt(5, 260), 40
    ref = prefill.generate([prompt], _greedy(n))[0]
    first, payload = _prefill(prefill, "cu-p", prompt)
    md.add_request("cu", prompt, _greedy(n), paused=True)
    md.import_kv("cu", payload)
    assert md.append_tokens("cu", ref[:4], 0) is False  # a first batch: nothing replaced
    md.resume("cu")
    while len(md.output_token_ids("cu")) < 10:
        md.step()  # MainDecode decodes ahead between rounds
    assert md.output_token_ids("cu")[:10] == ref[:10]
    x = next(t for t in range(3, 500) if t != ref[6])
    decided = [*ref[:6], x]
    assert md.append_tokens("cu", decided[4:], 4) is True  # what it decoded past 6 is replaced
    rest = [o.token_id for o in _run(md, "cu")]
    assert rest == prefill.generate([prompt + decided], _greedy(n - 7))[0]


def test_an_extension_that_ends_the_request_finishes_with_no_new_token(md, prefill):
    prompt, n = _prompt(6, 250), 6
    ref = prefill.generate([prompt], _greedy(n))[0]
    md.add_request("end", prompt, _greedy(n), paused=True)
    md.append_tokens("end", ref, 0)  # the relay finished it: every output handed over
    md.resume("end")
    (out,) = _run(md, "end")
    assert (out.token_id, out.position, out.finished, out.finish_reason) == (
        None,
        5,
        True,
        "length",
    )
    assert not md.holds_request("end")
    # Its prompt + outputs are in vLLM's prefix cache now: the session's next turn hits.
    assert md.prefix_match_len(prompt + ref + [7] * 60) == 256


def test_second_turn_imports_only_the_delta(md, prefill):
    """Turn 1 leaves prompt + outputs in the DRC; turn 2's prompt extends them, so MainDecode
    admits it with a hit and needs only the KV past it (what prefill pushes over the WAN)."""
    turn1, n = _prompt(7, 300), 30
    first, payload = _prefill(prefill, "t1-p", turn1)
    out1 = _decode_imported(md, "t1", turn1, payload, first, n)
    turn2 = turn1 + out1 + _prompt(8, 150)
    md.add_request("t2", turn2, _greedy(n), paused=True)
    hit = md.num_cached_tokens("t2")
    assert hit == 256  # 330 tokens of turn 1 in whole 128-token blocks
    first2, full = _prefill(prefill, "t2-p", turn2)
    delta = full.to_tensor()[:, :, hit:]  # [L, 2, n - hit, KV, D]
    assert delta.shape[2] == len(turn2) - hit
    md.import_kv("t2", KvPayload.from_tensor(delta, hit, 128))
    md.append_tokens("t2", [first2], 0)
    md.resume("t2")
    got = [first2] + [o.token_id for o in _run(md, "t2")]
    assert got == prefill.generate([turn2], _greedy(n))[0]
    assert delta.numel() * 4 < full.descriptor.nbytes * 0.5  # the WAN carries under half


def test_cache_events_are_pdds_chained_hashes_of_what_vllm_holds(md, md_events):
    prompt = _prompt(9, 400)
    md_events.clear()
    md.add_request("ev", prompt, _greedy(2), salt="tenant-a")
    tokens = prompt + [o.token_id for o in _run(md, "ev")]
    stored = [h for e in md_events if e.kind == "stored" for h in e.block_hashes]
    assert stored == chain_hashes(tokens, 128, "tenant-a")  # 3 full blocks, salted
    assert all(e.block_size == 128 and e.salt == "tenant-a" for e in md_events)
    # What kvstore predicts from these hashes is what vLLM's prefix cache serves.
    assert md.prefix_match_len(prompt, "tenant-a") == 384
    assert md.prefix_match_len(prompt, "tenant-b") == 0
    md.add_request("ev2", prompt, _greedy(1), salt="tenant-a", paused=True)
    assert md.num_cached_tokens("ev2") == 384
    md.abort("ev2")
    snapshot = [h for e in md.cache_snapshot() for h in e.block_hashes]
    assert set(stored) <= set(snapshot)


def test_abort_frees_vllms_blocks(md):
    pool = md._scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    md.add_request("ab", _prompt(10, 600), _greedy(64))
    for _ in range(3):
        md.step()
    assert pool.get_num_free_blocks() < free  # it holds blocks while running
    assert md.abort("ab") is True
    assert pool.get_num_free_blocks() == free and not md.holds_request("ab")
    assert not md.has_schedulable()


# --- the MainDecode role on vLLM, through the engine loop, the WAN receiver and the handoff ----


class _Instance:
    def __init__(self, engine, runner) -> None:
        self.engine, self.runner = engine, runner


async def _push(
    receiver: KvReceiver, loop: EngineLoop, eng, rid: str, prompt: list[int], start: int
) -> int:
    """Prefill ``prompt`` on ``eng`` and push ``[start, n)`` as a WAN push delivers it.

    NOTE: on the loop's thread: two vLLM engines must not step at once (vLLM's forward context
    is process-wide)."""

    def compute():
        eng.add_request(rid, prompt, _greedy(1), keep_after_finish=True)
        (first,) = _run(eng, rid)
        kv = export_tokens(eng, rid, start, len(prompt))
        eng.release(rid)
        return first, kv

    first, kv = await loop.call(compute)
    header = range_header(eng, rid, start, len(prompt), prompt, "")
    chunks = list(split(header, bytes(wire_bytes(kv, header.layout))))

    async def items():
        for item in (header, *chunks, Commit(rid, (first.token_id,))):
            yield item

    assert (await receiver.receive(items())).complete
    return first.token_id


async def test_main_decode_role_on_vllm_p_md_and_catch_up(md, prefill, ours):
    n = 24
    receiver = KvReceiver()
    loop = EngineLoop(md)
    await loop.start()
    try:
        role = MainDecode(_Instance(md, loop), receiver, kv_timeout_s=60)
        # P-MD, KV from our engine (mixed engines through the canonical format).
        prompt = _prompt(11, 280)
        stream = role.decode(DecodeJob("role-1", tuple(prompt), _greedy(n), "", Pipeline.P_MD))
        assert await anext(stream) == Accepted(0)
        first = await _push(receiver, loop, ours, "role-1", prompt, 0)
        events = [ev async for ev in stream]
        tokens = [t for ev in events if isinstance(ev, Tokens) for t in ev.token_ids]
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == n
        assert [first, *tokens] == (await loop.call(prefill.generate, [prompt], _greedy(n)))[0]
        # P-RLD-MD catch-up: two handoff batches, MainDecode speaks after the final one.
        prompt = _prompt(12, 300)
        (ref,) = await loop.call(prefill.generate, [prompt], _greedy(n))
        job = DecodeJob("role-2", tuple(prompt), _greedy(n), "", Pipeline.P_RLD_MD)
        stream = role.decode(job)
        assert await anext(stream) == Accepted(0)
        await _push(receiver, loop, prefill, "role-2", prompt, 0)
        rest = asyncio.create_task(_consume(stream))
        ack = await role.handoff(HandoffBatch("role-2", 0, tuple(ref[:5])))
        assert ack.extended_through == 5
        ack = await role.handoff(HandoffBatch("role-2", 5, tuple(ref[5:9]), final=True))
        assert ack.extended_through == 9
        events = await asyncio.wait_for(rest, 120)
        streamed = [ev for ev in events if isinstance(ev, Tokens)]
        assert streamed[0].start_position == 9
        assert [t for ev in streamed for t in ev.token_ids] == ref[9:]
        assert not md.holds_request("role-2")
    finally:
        await loop.stop()


async def _consume(stream) -> list:
    return [ev async for ev in stream]
