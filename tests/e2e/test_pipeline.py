"""The PDD pipeline end to end: gateway, kvstore, prefill, relay, main_decode as processes.

Reference: a single in-process engine on the same tiny model. Greedy outputs
through P-MD, P-RLD-MD one-shot, P-RLD-MD catch-up and MD (MainDecode
prefills locally) must equal it (up to an
explicit near-tie, see ``Oracle``); seeded sampling too.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdd.client import generate_stream
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as kv_pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as kv_grpc
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as p_grpc
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc
from pdd.serving.model_spec import load_model
from tests.e2e.conftest import BLOCK, TINY

P_MD, P_RLD_MD, MD = common_pb2.PIPELINE_P_MD, common_pb2.PIPELINE_P_RLD_MD, common_pb2.PIPELINE_MD
ONE_SHOT, CATCH_UP = common_pb2.HANDOFF_MODE_ONE_SHOT, common_pb2.HANDOFF_MODE_CATCH_UP
MODES = {
    "p-md": dict(force_pipeline=P_MD),
    "p-rld-md-one-shot": dict(force_pipeline=P_RLD_MD, handoff_mode=ONE_SHOT),
    "p-rld-md-catch-up": dict(force_pipeline=P_RLD_MD, handoff_mode=CATCH_UP),
    "md": dict(force_pipeline=MD),
}


@pytest.fixture(scope="module")
def reference():
    return Engine(load_model(TINY), EngineConfig(block_size=BLOCK))


@pytest.fixture(scope="module")
def oracle(llama_oracle):
    return llama_oracle(load_model(TINY))


async def run(stack, prompt, max_tokens=16, logprobs_out: list | None = None, **fields):
    tokens, stages, final = [], [], None
    async for resp in generate_stream(
        stack.gateway.address,
        list(prompt),
        max_tokens=max_tokens,
        timeout=120,
        ignore_eos=True,
        **fields,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids, (
            "gap or duplicate in the stream"
        )
        tokens.extend(resp.token_ids)
        if logprobs_out is not None:
            logprobs_out.extend(resp.logprobs)
        stages.extend([resp.stage] * len(resp.token_ids))
        if resp.HasField("stats"):
            final = resp
    assert final is not None
    return tokens, stages, final


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


async def wait_indexed(stack, prompt, salt, want):
    """Wait until kvstore's index shows a MainDecode holding ``want`` tokens of ``prompt``: cache
    events reach it asynchronously. Fails after 10 s."""
    async with grpc.aio.insecure_channel(stack.by_name("kvstore").address) as ch:
        kv = kv_grpc.KvstoreServiceStub(ch)
        best = 0
        for _ in range(200):
            hits = await kv.PredictHits(
                kv_pb.PredictHitsRequest(
                    prompt_token_ids=prompt, cache_salt=salt, role=common_pb2.ROLE_MAIN_DECODE
                )
            )
            best = max((h.cached_tokens for h in hits.hits), default=0)
            if best >= want:
                return
            await asyncio.sleep(0.05)
        pytest.fail(f"kvstore indexed {best} of {want} tokens of session {salt} after 10 s")


@pytest.mark.parametrize("mode", list(MODES))
async def test_greedy_equals_single_engine(stack, reference, oracle, mode):
    ps = prompts(hash(mode) % 1000, 5)
    lengths = [5, 24, 9, 17, 30]
    results = await asyncio.gather(
        *(run(stack, p, n, cache_salt=f"greedy-{mode}", **MODES[mode]) for p, n in zip(ps, lengths))
    )
    for p, n, (tokens, stages, final) in zip(ps, lengths, results):
        ref = reference.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        oracle.assert_greedy_equal(p, tokens, ref)
        s = final.stats
        assert s.completion_tokens == n == len(tokens)
        assert s.prompt_tokens == len(p)
        assert s.pipeline == MODES[mode]["force_pipeline"]
        if mode == "md":
            # MainDecode prefilled the prompt itself: every token is its own and no KV crossed the WAN.
            assert set(stages) == {common_pb2.STAGE_MAIN_DECODE}
            assert s.md_tokens == n and s.rld_tokens == 0 and s.wan_kv_bytes == 0
            assert s.ttft_ms > 0 and s.e2e_ms >= s.ttft_ms
            continue
        assert stages[0] == common_pb2.STAGE_PREFILL
        if mode == "p-md":
            assert s.rld_tokens == 0 and s.md_tokens == n - 1
            assert set(stages[1:]) <= {common_pb2.STAGE_MAIN_DECODE}
        else:
            assert s.rld_tokens + s.md_tokens == n - 1
            # relay tokens come first, MainDecode continues where the handoff put it
            k = s.handoff_at_token or n
            assert all(st == common_pb2.STAGE_RELAY for st in stages[1:k])
            assert all(st == common_pb2.STAGE_MAIN_DECODE for st in stages[k:])
        assert s.ttft_ms > 0 and s.e2e_ms >= s.ttft_ms


async def test_second_turn_pushes_only_the_delta(stack, reference):
    turn1 = prompts(11, 1)[0] + [7] * 20
    tokens1, _, f1 = await run(
        stack, turn1, 12, session_id="s1", cache_salt="delta", force_pipeline=P_MD
    )
    turn2 = turn1 + tokens1 + [9, 8, 7, 6, 5]
    held = (len(turn1) + len(tokens1) - 1) // BLOCK * BLOCK
    await wait_indexed(stack, turn2, "delta", held)
    tokens2, _, f2 = await run(
        stack, turn2, 6, session_id="s1", cache_salt="delta", force_pipeline=P_MD
    )
    s1, s2 = f1.stats, f2.stats
    bytes_per_token = s1.wan_kv_bytes // len(
        turn1
    )  # turn 1 was a cold miss: the whole prompt crossed
    assert s1.md_cached_tokens == 0 and s1.wan_kv_bytes == bytes_per_token * len(turn1)
    # MainDecode's DRC holds turn 1's prompt + output (its last token has no KV): full blocks of that.
    assert s2.md_cached_tokens == held
    assert s2.wan_kv_bytes == bytes_per_token * (len(turn2) - held)
    assert s2.predicted_hit_rate == pytest.approx(held / len(turn2))
    assert tokens2 == reference.generate([turn2], SamplingParams(max_tokens=6, ignore_eos=True))[0]


async def test_second_turn_prefilled_by_main_decode_sends_no_kv(stack, reference):
    turn1 = prompts(12, 1)[0] + [5] * 20
    tokens1, _, _ = await run(
        stack, turn1, 12, session_id="s2", cache_salt="local", force_pipeline=P_MD
    )
    turn2 = turn1 + tokens1 + [4, 3, 2, 1, 9, 8]
    held = (len(turn1) + len(tokens1) - 1) // BLOCK * BLOCK
    tokens2, stages2, f2 = await run(
        stack, turn2, 6, session_id="s2", cache_salt="local", force_pipeline=MD
    )
    s2 = f2.stats
    # MainDecode matched turn 1's prompt + output in its DRC and computed only the rest itself.
    assert s2.pipeline == MD and s2.md_cached_tokens == held and s2.wan_kv_bytes == 0
    assert set(stages2) == {common_pb2.STAGE_MAIN_DECODE}
    assert tokens2 == reference.generate([turn2], SamplingParams(max_tokens=6, ignore_eos=True))[0]


async def test_relay_frees_kv_after_handoff(stack):
    p = prompts(5, 1)[0]
    # NOTE: 300 tokens take the relay far longer than MainDecode needs to receive a few KB of KV.
    tokens, _, final = await run(
        stack, p, 300, cache_salt="free", force_pipeline=P_RLD_MD, handoff_mode=ONE_SHOT
    )
    assert 0 < final.stats.handoff_at_token < 300, "the relay should have handed over"
    rid = final.request_id
    async with grpc.aio.insecure_channel(stack.by_name("relay-0").address) as ch:
        r = await r_grpc.RelayServiceStub(ch).DescribeCache(
            r_pb.DescribeCacheRequest(request_id=rid)
        )
    assert not r.request_holds_kv


async def test_request_finishing_on_relay_still_lands_in_the_drc(stack):
    p = prompts(6, 1)[0] + [3] * 16
    tokens, stages, final = await run(
        stack, p, 1, cache_salt="finish-first", force_pipeline=P_RLD_MD
    )
    assert len(tokens) == 1
    async with grpc.aio.insecure_channel(stack.by_name("wan-0").address) as ch:
        md = md_grpc.MainDecodeServiceStub(ch)
        for _ in range(300):  # 15 s for a loaded machine
            r = await md.DescribeCache(
                md_pb.DescribeCacheRequest(token_ids=p + tokens, cache_salt="finish-first")
            )
            if r.cached_prefix_tokens == (len(p) + len(tokens)) // BLOCK * BLOCK:
                break
            await asyncio.sleep(0.05)
    assert r.cached_prefix_tokens == (len(p) + len(tokens)) // BLOCK * BLOCK


@pytest.mark.parametrize("mode", list(MODES))
async def test_seeded_sampling_matches_single_engine(stack, reference, mode):
    p = prompts(21, 1)[0]
    tokens, _, _ = await run(
        stack, p, 20, temperature=0.8, seed=1234, cache_salt=f"seed-{mode}", **MODES[mode]
    )
    ref = reference.generate(
        [p], SamplingParams(max_tokens=20, temperature=0.8, seed=1234, ignore_eos=True)
    )[0]
    assert tokens == ref
    other, _, _ = await run(
        stack, p, 20, temperature=0.8, seed=99, cache_salt=f"seed-{mode}", **MODES[mode]
    )
    assert other != tokens


@pytest.mark.parametrize("mode", list(MODES))
async def test_bias_and_penalties_match_single_engine_across_the_handoff(stack, reference, mode):
    # NOTE: values exact in float32 (the wire's type), so the reference gets the very same numbers.
    penalties = dict(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.25,
        logit_bias={9: -100.0, 7: 1.5},
    )
    p = prompts(23, 1)[0] + [7, 7, 7, 9]
    # NOTE: long enough that the relay hands over (where exactly is timing: the same tokens either way;
    # the engine-level test pins a handoff after relay tokens down).
    tokens, _, _ = await run(
        stack,
        p,
        200,
        temperature=0.75,
        seed=4321,
        cache_salt=f"pen-{mode}",
        **penalties,
        **MODES[mode],
    )
    ref = reference.generate(
        [p],
        SamplingParams(max_tokens=200, temperature=0.75, seed=4321, ignore_eos=True, **penalties),
    )[0]
    assert tokens == ref and 9 not in tokens
    plain = reference.generate(
        [p], SamplingParams(max_tokens=200, temperature=0.75, seed=4321, ignore_eos=True)
    )[0]
    assert plain != ref, "the penalties should change this output"


@pytest.mark.parametrize("mode", list(MODES))
async def test_logprobs_of_every_token_whichever_stage_sampled_it(stack, reference, mode):
    p = prompts(29, 1)[0]
    got: list = []
    sp = SamplingParams(max_tokens=120, temperature=0.9, seed=77, ignore_eos=True, logprobs=3)
    tokens, stages, _ = await run(
        stack,
        p,
        120,
        logprobs_out=got,
        temperature=0.9,
        seed=77,
        logprobs=3,
        cache_salt=f"logprobs-{mode}",
        **MODES[mode],
    )
    reference.add_request("ref-logprobs", p, sp)
    want = []
    while reference.has_unfinished():
        want += [o for o in reference.step() if o.request_id == "ref-logprobs"]
    assert tokens == [o.token_id for o in want] and len(got) == len(tokens)
    for i, (lp, ref) in enumerate(zip(got, want)):
        # NOTE: another stage's kernels (a decode step vs an extension chunk): equal up to float noise
        assert lp.logprob == pytest.approx(ref.logprob.logprob, abs=1e-3), (i, stages[i])
        assert (
            list(lp.top_token_ids) == [t for t, _ in ref.logprob.top]
            or min(abs(a - b) for a, b in zip(lp.top_logprobs[1:], lp.top_logprobs)) < 1e-3
        ), (i, stages[i])
        assert list(lp.top_logprobs) == pytest.approx([v for _, v in ref.logprob.top], abs=1e-3)
    plain: list = []
    await run(stack, p, 4, logprobs_out=plain, cache_salt=f"logprobs-{mode}", **MODES[mode])
    assert plain == []  # only when asked for


@pytest.mark.parametrize("mode", ["p-md", "p-rld-md-one-shot", "md"])
async def test_cancel_mid_stream_frees_kv_everywhere(stack, mode):
    p = prompts(31, 1)[0]
    rid = f"cancel-{mode}"
    seen = 0
    stream = generate_stream(
        stack.gateway.address, p, max_tokens=400, ignore_eos=True, request_id=rid, **MODES[mode]
    )
    async for resp in stream:
        seen += len(resp.token_ids)
        if seen >= 3:
            break
    await stream.aclose()
    stubs = [
        (p_grpc.PrefillServiceStub, p_pb.DescribeCacheRequest, "prefill-0"),
        (r_grpc.RelayServiceStub, r_pb.DescribeCacheRequest, "relay-0"),
        (md_grpc.MainDecodeServiceStub, md_pb.DescribeCacheRequest, "wan-0"),
    ]
    for stub_cls, req_cls, name in stubs:
        async with grpc.aio.insecure_channel(stack.by_name(name).address) as ch:
            stub = stub_cls(ch)
            for _ in range(300):  # 15 s for a loaded machine
                if not (await stub.DescribeCache(req_cls(request_id=rid))).request_holds_kv:
                    break
                await asyncio.sleep(0.05)
            assert not (await stub.DescribeCache(req_cls(request_id=rid))).request_holds_kv, name


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(prompt_token_ids=[]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, 999]), "prompt_token_ids[1]"),
        (dict(prompt_token_ids=[1] * 600), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, 2], max_tokens=0), "max_tokens"),
        (dict(prompt_token_ids=[1, 2], max_tokens=10_000_000), "max_tokens"),
        (dict(prompt_token_ids=[1, 2], top_p=1.5), "top_p"),
        (dict(prompt_token_ids=[1, 2], session_id="has space"), "session_id"),
        (dict(prompt_token_ids=[1, 2], force_pipeline=9), "force_pipeline"),
        (dict(prompt="text needs a tokenizer"), "prompt"),
        (dict(), "prompt"),
    ],
)
async def test_bad_input_is_invalid_argument_and_the_stack_keeps_serving(stack, fields, field):
    from pdd.gen.gateway.v1 import gateway_service_pb2 as g_pb
    from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as g_grpc

    request = g_pb.GenerateRequest(max_tokens=fields.pop("max_tokens", 4))
    if "prompt_token_ids" in fields:
        request.prompt_token_ids.token_ids.extend(fields.pop("prompt_token_ids"))
    for k, v in fields.items():
        setattr(request, k, v)
    async with grpc.aio.insecure_channel(stack.gateway.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in g_grpc.GatewayServiceStub(ch).Generate(request, timeout=30):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    tokens, _, _ = await run(stack, [1, 2, 3], 2)
    assert len(tokens) == 2
