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
from pdd.testbed.stack import LinkSettings, Stack, StackConfig
from tests.e2e.conftest import BLOCK, TINY
from tests.e2e.test_pipeline import prompts

WAN_DELAY_MS = 200.0
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    config = StackConfig(
        model=TINY,
        redis_url=redis_url,
        gateway_port=0,
        main_decode=2,
        wan=LinkSettings(delay_ms=WAN_DELAY_MS),
        engine_flags=(
            "--block-size",
            str(BLOCK),
            "--kv-cache-mb",
            "32",
            "--threads",
            "1",
            "--lease-ttl-ms",
            "3000",
        ),
        gateway_flags=("--seed", "0", "--stage-timeout-s", "60"),
        log_dir=tmp_path_factory.mktemp("migration") / "logs",
        key_prefix="migration",
    )
    s = Stack(config).start()
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


async def test_a_main_decode_killed_mid_stream_is_migrated_without_a_gap(stack, oracle):
    p = prompts(91, 1)[0]
    rid = "migrate-greedy"
    tokens: list[int] = []
    final = victim = None
    async for resp in generate_stream(
        stack.gateway.address,
        p,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        timeout=120,
        force_pipeline=common_pb2.PIPELINE_P_MD,
        cache_salt="migrate",
        request_id=rid,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids  # no gap, no repeat
        tokens.extend(resp.token_ids)
        if victim is None and len(tokens) >= 3:  # MainDecode speaks from output 1
            victim = _serving(stack, rid)
            victim.proc.send_signal(signal.SIGKILL)
        if resp.HasField("stats"):
            final = resp
    assert victim is not None and final is not None and len(tokens) == MAX_TOKENS
    ref = Engine(load_model(TINY), EngineConfig(block_size=BLOCK)).generate(
        [p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    oracle.assert_greedy_equal(p, tokens, ref)
    assert final.stats.main_decode_instance not in ("", victim.name)
    gateway_log = stack.gateway.log_path.read_text()
    if "migrated" not in gateway_log:
        pytest.fail("MainDecode finished before it was killed; the migration did not run")
    assert "main_decode_lost" in gateway_log
