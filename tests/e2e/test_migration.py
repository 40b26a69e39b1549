"""A MainDecode SIGKILLed mid-decode: the gateway moves the request to the other MainDecode,
resuming from the tokens streamed, and the client's stream goes on unbroken.

Runs its own stack (two MainDecodes, each behind its own WAN link): the test kills one. P-MD is
forced and the output is long, and the WAN's one-way delay keeps the client's view behind what
MainDecode has produced, so the kill lands while MainDecode still decodes, never after its end.
"""

from __future__ import annotations

import signal

import pytest

from pdd.client import generate_stream
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.serving.model_spec import load_model
from pdd.testbed.stack import LinkSettings
from tests.e2e.conftest import BLOCK, TINY, make_stack
from tests.e2e.test_pipeline import prompts

WAN_DELAY_MS = 200.0
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("migration"),
        wan=LinkSettings(delay_ms=WAN_DELAY_MS),
        gateway_flags=("--stage-timeout-s", "60"),
        main_decode=2,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(llama_oracle):
    return llama_oracle(load_model(TINY))


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


async def _generate(stack, p: list[int], rid: str, *, kill: bool, **sampling):
    """Stream one forced P-MD request (``kill``: SIGKILL its MainDecode once MainDecode has
    spoken); its tokens, final message and the MainDecode killed."""
    tokens: list[int] = []
    final = victim = None
    async for resp in generate_stream(
        stack.gateway.address,
        p,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        timeout=120,
        force_pipeline=common_pb2.PIPELINE_P_MD,
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
    assert final is not None and len(tokens) == MAX_TOKENS
    assert not kill or victim is not None
    return tokens, final, victim


def _migrated(stack, rid: str) -> None:
    lines = [line for line in stack.gateway.log_path.read_text().splitlines() if rid in line]
    if not any('"migrated"' in line for line in lines):
        pytest.fail("MainDecode finished before it was killed; the migration did not run")
    assert any("main_decode_lost" in line for line in lines)


async def test_a_main_decode_killed_mid_stream_is_migrated_without_a_gap(stack, oracle):
    _two_main_decodes(stack)
    p = prompts(91, 1)[0]
    rid = "migrate-greedy"
    tokens, final, victim = await _generate(stack, p, rid, kill=True)
    ref = Engine(load_model(TINY), EngineConfig(block_size=BLOCK)).generate(
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
    greedy = Engine(load_model(TINY), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    assert want != greedy  # the request did sample
