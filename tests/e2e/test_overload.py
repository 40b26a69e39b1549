"""Overload: a stack whose engine roles admit 2 requests each, flooded with many more at once.

Every request either completes with the reference output or is refused with RESOURCE_EXHAUSTED
within about a second (the stage refuses at its admit step, the gateway finds no other instance
of the role and refuses the client); none hangs, and afterwards no engine holds any of their KV.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdd.client import generate_stream
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.serving.model_spec import load_model
from tests.e2e.conftest import BLOCK, TINY, make_stack, no_kv_held
from tests.e2e.test_pipeline import prompts

FLOOD = 16
MAX_TOKENS = 48
# NOTE: a refusal is answered before any work; the margin covers a loaded 2-core machine.
REFUSED_WITHIN_S = 1.5


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("overload"),
        extra_engine=("--max-admitted", "2"),
    )
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


@pytest.fixture(scope="module")
def oracle(llama_oracle):
    return llama_oracle(load_model(TINY))


async def _one(stack, prompt: list[int], rid: str) -> tuple[list[int] | None, float]:
    """The request's tokens (None if refused) and how long until its answer or refusal."""
    tokens: list[int] = []
    t0 = time.monotonic()
    try:
        async for resp in generate_stream(
            stack.gateway.address,
            prompt,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            timeout=120,
            request_id=rid,
            cache_salt=rid,
        ):
            tokens.extend(resp.token_ids)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert "is full" in (exc.details() or ""), exc.details()
        assert not tokens, "a request refused after it had tokens: an admitted one was dropped"
        return None, time.monotonic() - t0
    return tokens, time.monotonic() - t0


async def test_a_flood_is_served_or_refused_at_once_and_leaves_no_kv(stack, oracle):
    ps = prompts(16, FLOOD)
    rids = [f"flood-{i}" for i in range(FLOOD)]
    # NOTE: none may hang: every one ends long before the client's own deadline
    results = await asyncio.wait_for(
        asyncio.gather(*(_one(stack, p, rid) for p, rid in zip(ps, rids))), 110
    )
    served = [(p, t) for p, (t, _) in zip(ps, results) if t is not None]
    refused = [s for t, s in results if t is None]
    assert served, "nothing was admitted"
    assert refused, f"{FLOOD} at once on stages admitting 2 each: some must be refused"
    assert max(refused) < REFUSED_WITHIN_S, f"refusals took {sorted(refused)} s"
    engine = Engine(load_model(TINY), EngineConfig(block_size=BLOCK))
    refs = engine.generate(
        [p for p, _ in served], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    for (p, tokens), ref in zip(served, refs):
        oracle.assert_greedy_equal(p, tokens, ref)
    for rid in rids:
        await no_kv_held(stack, rid)
    # the stack serves on once the flood is over
    tokens, _ = await _one(stack, ps[0], "after-flood")
    assert tokens is not None and len(tokens) == MAX_TOKENS
