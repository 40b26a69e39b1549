"""A stack with two MainDecode instances (each behind its own WAN link), and a relay that dies.

Runs its own stack: the last test kills the relay process. The WAN has a one-way delay so that
MainDecode cannot hold a request's KV before the relay has streamed its first tokens: without it
the relay could hand over before the test kills it (seen once in CI on a loaded machine).
"""

from __future__ import annotations

import signal

import pytest

from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.serving.model_spec import load_model
from pdd.testbed.stack import LinkSettings
from tests.e2e.conftest import BLOCK, TINY, make_stack
from tests.e2e.test_pipeline import prompts, run, wait_indexed

WAN_DELAY_MS = 400.0


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    # NOTE: the relay can hand over only once MainDecode's "KV ready" reached it: the KV's hop to
    # MainDecode, then the reply's hop back (>= 0.8 s), against the few ms until the test sees its token.
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("topology"),
        wan=LinkSettings(delay_ms=WAN_DELAY_MS),
        # NOTE: the report's θ router: on this 800 ms-RTT link the link-aware default would send
        # even a 95 %-hit turn through the relay (its transfer estimate exceeds the TTFT budget);
        # the link-aware choice has its own tests (test_relay_guard, test_clusters, unit tests).
        gateway_flags=("--stage-timeout-s", "60", "--pipeline-policy", "threshold"),
        main_decode=2,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    return Engine(load_model(TINY), EngineConfig(block_size=BLOCK))


async def test_sessions_stick_to_the_main_decode_holding_their_prefix(stack):
    chosen = {}
    for s in range(4):
        salt = f"session-{s}"
        # NOTE: long enough that the DRC hit is >= 0.95 and that its affinity (~1.5 running requests'
        # worth) outweighs a load report still counting turn 1 (seen on a loaded machine).
        turn1 = prompts(100 + s, 1)[0] + [5] * 340
        out1, _, f1 = await run(
            stack, turn1, 8, cache_salt=salt, force_pipeline=common_pb2.PIPELINE_P_MD
        )
        turn2 = turn1 + out1 + [1, 2, 3]
        held = (len(turn1) + len(out1) - 1) // BLOCK * BLOCK
        await wait_indexed(stack, turn2, salt, held)
        _, _, f2 = await run(stack, turn2, 4, cache_salt=salt)
        assert f2.stats.main_decode_instance == f1.stats.main_decode_instance
        assert f2.stats.md_cached_tokens == held
        assert f2.stats.pipeline == common_pb2.PIPELINE_P_MD  # high hit: no relay
        chosen[s] = f1.stats.main_decode_instance
    assert set(chosen.values()) == {"main_decode-0", "main_decode-1"}, (
        "load spreads over both instances"
    )


async def test_gateway_drives_the_handoff_when_the_relay_dies(stack, reference):
    p = prompts(77, 1)[0]
    relay = stack.by_name("relay-0")
    tokens = []
    final = None
    from pdd.client import generate_stream

    async for resp in generate_stream(
        stack.gateway.address,
        p,
        max_tokens=300,
        ignore_eos=True,
        timeout=60,
        force_pipeline=common_pb2.PIPELINE_P_RLD_MD,
        handoff_mode=common_pb2.HANDOFF_MODE_ONE_SHOT,
        cache_salt="dies",
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids
        tokens.extend(resp.token_ids)
        if len(tokens) >= 2 and relay.alive():
            relay.proc.send_signal(signal.SIGKILL)
        if resp.HasField("stats"):
            final = resp
    assert final is not None and len(tokens) == 300
    assert tokens == reference.generate([p], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    assert final.stats.handoff_at_token >= 2
    if "relay_lost_gateway_handoff" not in stack.gateway.log_path.read_text():
        pytest.fail(
            "the relay handed over before it was killed; the gateway's takeover did not run"
        )
