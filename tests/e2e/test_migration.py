"""A MainDecode SIGKILLed mid-decode: the gateway moves the request to the other MainDecode,
resuming from the tokens streamed, and the client's stream goes on unbroken. In P-RLD-MD,
one SIGKILLed before its KV arrived: the relay decodes on alone while the gateway re-homes the
request on the other MainDecode and takes it from the relay; with no other one, the relay
finishes the request.

Runs its own stack (two MainDecodes, each behind its own WAN link): the test kills one. P-MD is
forced and the output is long, and the WAN's one-way delay keeps the client's view behind what
MainDecode has produced, so the kill lands while MainDecode still decodes, never after its end.
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
from pdd.server.tls import TlsConfig, open_channel
from pdd.serving.model_spec import load_model
from pdd.testbed.stack import LinkSettings
from pdd.wire.kvstore_client import KvstoreClient
from tests.e2e.conftest import BLOCK, logged, make_stack, no_kv_held
from tests.e2e.test_pipeline import prompts

WAN_DELAY_MS = 200.0
MAX_TOKENS = 400
# NOTE: a longer context than the other stacks' so the relay, decoding alone, is still
# streaming after the ≥ 3 WAN round trips (≥ 1.2 s) that re-homing the request takes; and
# wider, deeper layers than the default tiny model, so that decoding outlasts the kill on a
# fast host (the default decoded all 400 tokens within the WAN's one-way delay here: ~0.4 ms a
# token in the service, so the client's third token came after MainDecode had finished).
MODEL = "tiny:7,ctx=2048,hidden=256,inter=768,layers=8"
RELAY_TOKENS = 1600


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("migration"),
        wan=LinkSettings(delay_ms=WAN_DELAY_MS),
        gateway_flags=("--stage-timeout-s", "60"),
        main_decode=2,
        model=MODEL,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(llama_oracle):
    return llama_oracle(load_model(MODEL))


def _serving(stack, request_id: str):
    """The MainDecode process that accepted ``request_id`` (its log says so)."""
    for i in range(2):
        md = stack.by_name(f"main_decode-{i}")
        lines = md.log_path.read_text().splitlines()
        if any("md_accepted" in line and request_id in line for line in lines):
            return md
    raise AssertionError(f"no MainDecode accepted {request_id}")


def _two_main_decodes(stack) -> None:
    """Both MainDecodes up: one an earlier test killed is started again on its address (it
    registers with kvstore before it says it listens)."""
    for i in range(2):
        md = stack.by_name(f"main_decode-{i}")
        if not md.alive():
            assert stack.restart(md.name).wait_listening(120), f"{md.name} did not come back"


async def _generate(
    stack,
    p: list[int],
    rid: str,
    *,
    kill: bool,
    pipeline=common_pb2.PIPELINE_P_MD,
    max_tokens: int = MAX_TOKENS,
    **sampling,
):
    """Stream one forced P-MD (or ``pipeline``) request (``kill``: SIGKILL its MainDecode once
    the client has 3 tokens: MainDecode has spoken in P-MD, only the relay in P-RLD-MD); its
    tokens, final message and the MainDecode killed."""
    tokens: list[int] = []
    final = victim = None
    if pipeline == common_pb2.PIPELINE_P_RLD_MD:
        sampling.setdefault("handoff_mode", common_pb2.HANDOFF_MODE_ONE_SHOT)
    async for resp in generate_stream(
        stack.gateway.address,
        p,
        max_tokens=max_tokens,
        ignore_eos=True,
        timeout=120,
        force_pipeline=pipeline,
        cache_salt=rid,
        request_id=rid,
        **sampling,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids  # no gap, no repeat
        tokens.extend(resp.token_ids)
        if kill and victim is None and len(tokens) >= 3:  # MainDecode speaks from output 1
            victim = _serving(stack, rid)
            victim.proc.send_signal(signal.SIGKILL)
        if resp.HasField("stats"):
            final = resp
    assert final is not None and len(tokens) == max_tokens
    assert not kill or victim is not None
    return tokens, final, victim


def _migrated(stack, rid: str) -> None:
    moves = logged(stack.gateway, rid, "migrated")
    if not moves:
        pytest.fail("MainDecode finished before it was killed; the migration did not run")
    assert any(m["cause"] == "main_decode_lost" for m in moves)


async def test_a_main_decode_killed_mid_stream_is_migrated_without_a_gap(stack, oracle):
    _two_main_decodes(stack)
    p = prompts(91, 1)[0]
    rid = "migrate-greedy"
    tokens, final, victim = await _generate(stack, p, rid, kill=True)
    ref = Engine(load_model(MODEL), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    oracle.assert_greedy_equal(p, tokens, ref)
    assert final.stats.main_decode_instance not in ("", victim.name)
    assert final.stats.migrations == 1
    _migrated(stack, rid)


async def test_a_seeded_request_migrated_mid_stream_samples_what_it_would_have_without_it(stack):
    """Draws depend only on (seed, position): the MainDecode it moved to samples the very tokens
    the lost one would have."""
    _two_main_decodes(stack)
    p = prompts(93, 1)[0]
    seeded = dict(temperature=0.8, seed=4242)
    want, clean, _ = await _generate(stack, p, "seeded-fault-free", kill=False, **seeded)
    assert clean.stats.migrations == 0
    rid = "migrate-seeded"
    tokens, final, victim = await _generate(stack, p, rid, kill=True, **seeded)
    assert tokens == want
    assert final.stats.main_decode_instance not in ("", victim.name)
    assert final.stats.migrations == 1
    _migrated(stack, rid)
    greedy = Engine(load_model(MODEL), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    assert want != greedy  # the request did sample


def _reference(p: list[int], n: int = RELAY_TOKENS) -> list[int]:
    return Engine(load_model(MODEL), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=n, ignore_eos=True)
    )[0]


async def test_a_main_decode_killed_before_its_kv_is_replaced_beside_the_streaming_relay(
    stack, oracle
):
    """P-RLD-MD, MainDecode SIGKILLed while its KV is still on the WAN (200 ms one way): the
    relay keeps the stream going, the other MainDecode rebuilds the KV from the tokens streamed,
    and takes the request over from the relay."""
    _two_main_decodes(stack)
    p = prompts(95, 1)[0]
    rid = "rehome-greedy"
    tokens, final, victim = await _generate(
        stack, p, rid, kill=True, pipeline=common_pb2.PIPELINE_P_RLD_MD, max_tokens=RELAY_TOKENS
    )
    oracle.assert_greedy_equal(p, tokens, _reference(p))
    s = final.stats
    assert s.main_decode_instance not in ("", victim.name) and s.migrations == 1
    if not logged(stack.gateway, rid, "rehomed"):
        pytest.fail("the relay handed over before the kill; the re-home did not run")
    assert logged(stack.by_name("relay-0"), rid, "relay_main_decode_lost")
    assert s.rld_tokens > 0 and s.md_tokens > 0  # the relay spoke, then the new MainDecode
    await no_kv_held(stack, rid)


async def _unlisted(stack, name: str, timeout_s: float = 20.0) -> None:
    """Wait until kvstore no longer lists ``name`` (its lease lapsed)."""
    deadline = time.monotonic() + timeout_s
    async with open_channel(stack.by_name("kvstore").address, TlsConfig()) as channel:
        client = KvstoreClient(channel)
        while any(i.ref.instance_id == name for i in await client.list()):
            assert time.monotonic() < deadline, f"kvstore still lists {name}"
            await asyncio.sleep(0.2)


async def test_with_no_main_decode_left_the_relay_finishes_the_request(stack, oracle):
    _two_main_decodes(stack)
    stack.by_name("main_decode-1").proc.send_signal(signal.SIGKILL)  # only main_decode-0 is left
    stack.by_name("main_decode-1").proc.wait(10)
    await _unlisted(stack, "main_decode-1")  # NOTE: so the router picks main_decode-0
    p = prompts(97, 1)[0]
    rid = "relay-alone"
    tokens, final, victim = await _generate(
        stack, p, rid, kill=True, pipeline=common_pb2.PIPELINE_P_RLD_MD, max_tokens=RELAY_TOKENS
    )
    assert victim.name == "main_decode-0"
    oracle.assert_greedy_equal(p, tokens, _reference(p))
    assert final.stats.rld_tokens == RELAY_TOKENS - 1 and final.stats.md_tokens == 0
    assert logged(stack.by_name("relay-0"), rid, "relay_finished_alone")
    await no_kv_held(stack, rid)
