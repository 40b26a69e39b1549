"""A partitioned WAN and a lost Redis, injected for real into a stack of its own.

The partition: the WAN emulator in front of MainDecode is SIGSTOPped (nothing crosses either
way, as with a cut link) right when the client has its first token, so the request's KV is
still on the WAN. P-MD: MainDecode cannot speak, and past the gateway's KV deadline (1 s here)
the relay takes the request from what was streamed and finishes it. P-RLD-MD: the relay streams
every token during the partition; MainDecode gets its KV when the link returns. Either way the
output is a single engine's, and afterwards no engine holds the request's KV.

Redis: SIGKILLed while a request streams and while new ones arrive; both are served (routing
falls back to the last known instances); Redis comes back empty, the instances republish what
they hold and kvstore predicts a session's cached prefix again.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pdd.client import generate_stream
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.serving.model_spec import load_model
from pdd.testbed.stack import LinkSettings
from tests.e2e.conftest import BLOCK, TINY, logged, make_stack, no_kv_held
from tests.e2e.test_pipeline import prompts, wait_indexed

KV_DEADLINE_S = 1.0
PARTITION_S = 3.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # NOTE: redis_url "": the stack starts (and the test kills) a Redis of its own.
    s = make_stack(
        "",
        tmp_path_factory.mktemp("outages"),
        wan=LinkSettings(delay_ms=300.0),
        gateway_flags=("--kv-deadline-s", str(KV_DEADLINE_S), "--stage-timeout-s", "60"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(llama_oracle):
    return llama_oracle(load_model(TINY))


def _reference(p: list[int], n: int) -> list[int]:
    return Engine(load_model(TINY), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=n, ignore_eos=True)
    )[0]


async def _partition(stack, seconds: float) -> float:
    """Cut the WAN in front of MainDecode for ``seconds``; when it came back (monotonic)."""
    link = stack.by_name("wan-0")
    link.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        link.proc.send_signal(signal.SIGCONT)
    return time.monotonic()


async def _generate(stack, p, rid, n, pipeline, *, at_first=None):
    """Stream one forced request; ``at_first``: a coroutine function started at its first
    token. Its tokens, final message, arrival time of its last token, and at_first's result."""
    tokens: list[int] = []
    final = last_at = None
    side: asyncio.Task | None = None
    extra = {"handoff_mode": common_pb2.HANDOFF_MODE_ONE_SHOT} if pipeline else {}
    async for resp in generate_stream(
        stack.gateway.address,
        p,
        max_tokens=n,
        ignore_eos=True,
        timeout=60,
        force_pipeline=pipeline or common_pb2.PIPELINE_P_MD,
        cache_salt=rid,
        request_id=rid,
        **extra,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids  # no gap, no repeat
        tokens.extend(resp.token_ids)
        if resp.token_ids:
            last_at = time.monotonic()
        if tokens and side is None and at_first is not None:
            side = asyncio.create_task(at_first())
        if resp.HasField("stats"):
            final = resp
    assert final is not None and len(tokens) == n
    return tokens, final, last_at, (await side if side is not None else None)


async def test_a_p_md_request_cut_off_by_a_partition_is_rerouted_through_the_relay(stack, oracle):
    p, n, rid = prompts(201, 1)[0], 160, "partition-p-md"
    tokens, final, _, _ = await _generate(
        stack, p, rid, n, 0, at_first=lambda: _partition(stack, PARTITION_S)
    )
    oracle.assert_greedy_equal(p, tokens, _reference(p, n))
    s = final.stats
    assert (s.relay_instance, s.migrations, s.md_tokens) == ("relay-0", 1, 0)
    assert s.rld_tokens == n - 1  # prefill's first token, then the relay's
    (rerouted,) = logged(stack.gateway, rid, "rerouted_through_relay")
    assert rerouted["at"] >= 1 and logged(stack.by_name("relay-0"), rid, "relay_resumed")
    await no_kv_held(stack, rid)


async def test_a_p_rld_md_request_streams_from_the_relay_through_a_partition(stack, oracle):
    p, n, rid = prompts(203, 1)[0], 120, "partition-p-rld-md"
    tokens, final, last_at, healed_at = await _generate(
        stack,
        p,
        rid,
        n,
        common_pb2.PIPELINE_P_RLD_MD,
        at_first=lambda: _partition(stack, PARTITION_S),
    )
    oracle.assert_greedy_equal(p, tokens, _reference(p, n))
    # every token reached the client while the link was still cut: the relay streamed them
    assert last_at < healed_at and final.stats.rld_tokens == n - 1
    await no_kv_held(stack, rid)


async def test_redis_lost_mid_request_degrades_routing_not_serving(stack, oracle):
    assert stack.redis is not None
    p, n = prompts(205, 1)[0], 80

    async def kill_redis() -> None:
        stack.redis.send_signal(signal.SIGKILL)
        stack.redis.wait(10)

    tokens, _, _, _ = await _generate(stack, p, "redis-in-flight", n, 0, at_first=kill_redis)
    oracle.assert_greedy_equal(p, tokens, _reference(p, n))
    # a new request while Redis is down is routed from the last known instances and served
    q = prompts(207, 1)[0]
    during, _, _, _ = await _generate(stack, q, "redis-down", 24, 0)
    oracle.assert_greedy_equal(q, during, _reference(q, 24))
    assert stack.redis.poll() is not None  # it really was down for both
    stack.restart_redis()
    # Redis came back empty: MainDecode republishes its DRC (a snapshot on reconnect), and
    # kvstore predicts the session's prompt + output as held again
    done = p + tokens
    await wait_indexed(stack, done, "redis-in-flight", (len(done) - 1) // BLOCK * BLOCK)
