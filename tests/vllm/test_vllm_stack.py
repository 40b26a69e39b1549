"""A whole stack on vLLM: kvstore, gateway, and prefill, relay and MainDecode each a separate
service process running ``--engine vllm`` (vLLM's CPU build, in the vLLM venv).

One stack per module (three vLLM starts, one at a time: the stack waits for each service).
Multi-block prompts (the CPU build's blocks are 128 tokens) go through P-MD and P-RLD-MD (one-shot
and catch-up), forced at the gateway; greedy output must equal vLLM alone (``generate`` on an
in-process vLLM engine on the same weights), and afterwards no engine holds the request.
"""

from __future__ import annotations

import uuid

import pytest

from pdd.client import generate_stream
from pdd.gen.common.v1 import common_pb2
from pdd.testbed.stack import LinkSettings, Stack, StackConfig
from tests.e2e.conftest import no_kv_held
from tests.vllm.conftest import MODEL

P_MD, P_RLD_MD = common_pb2.PIPELINE_P_MD, common_pb2.PIPELINE_P_RLD_MD
ONE_SHOT, CATCH_UP = common_pb2.HANDOFF_MODE_ONE_SHOT, common_pb2.HANDOFF_MODE_CATCH_UP
MODES = {
    "p-md": dict(force_pipeline=P_MD),
    "p-rld-md-one-shot": dict(force_pipeline=P_RLD_MD, handoff_mode=ONE_SHOT),
    "p-rld-md-catch-up": dict(force_pipeline=P_RLD_MD, handoff_mode=CATCH_UP),
}


@pytest.fixture(scope="module")
def vllm_stack(redis_url, tmp_path_factory):
    config = StackConfig(
        model=MODEL,
        redis_url=redis_url,
        gateway_port=0,
        # NOTE: a prompt's KV (~300 KB) takes ~0.1 s to cross: the relay speaks before the handoff.
        wan=LinkSettings(mbps=20),
        engine_flags=("--engine", "vllm", "--threads", "1", "--max-num-seqs", "8"),
        gateway_flags=("--seed", "0"),
        log_dir=tmp_path_factory.mktemp("vllm-stack") / "logs",
        key_prefix=f"vllm{uuid.uuid4().hex[:8]}",
    )
    stack = Stack(config).start()
    yield stack
    codes = stack.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 41 + i * 13 + (i * i) % 19) % 500 for i in range(n)]


async def _run(stack: Stack, prompt: list[int], n: int, rid: str, **fields):
    tokens, stages, final = [], [], None
    async for resp in generate_stream(
        stack.gateway.address,
        prompt,
        max_tokens=n,
        timeout=180,
        ignore_eos=True,
        request_id=rid,
        **fields,
    ):
        assert resp.start_position == len(tokens) or not resp.token_ids, "gap or duplicate"
        tokens.extend(resp.token_ids)
        stages.extend([resp.stage] * len(resp.token_ids))
        if resp.HasField("stats"):
            final = resp
    assert final is not None
    return tokens, stages, final.stats


@pytest.mark.parametrize("mode", list(MODES))
async def test_stack_of_vllm_services_equals_vllm_alone(vllm_stack, prefill, mode):
    from pdd.core.sampling_params import SamplingParams

    n, rid = 32, f"stack-{mode}-{uuid.uuid4().hex[:6]}"
    prompt = _prompt(len(mode), 300 + len(mode))  # three 128-token blocks, the last partial
    (alone,) = prefill.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    tokens, stages, s = await _run(vllm_stack, prompt, n, rid, cache_salt=mode, **MODES[mode])
    assert tokens == alone
    assert s.pipeline == MODES[mode]["force_pipeline"]
    assert s.prompt_tokens == len(prompt) and s.completion_tokens == n
    assert stages[0] == common_pb2.STAGE_PREFILL
    assert s.wan_kv_bytes > 0  # the prompt's KV crossed to MainDecode (a cold DRC)
    if mode == "p-md":
        assert s.rld_tokens == 0 and s.md_tokens == n - 1
        assert set(stages[1:]) == {common_pb2.STAGE_MAIN_DECODE}
    else:
        assert s.handoff_mode == MODES[mode]["handoff_mode"]
        assert s.relay_instance == "relay-0" and s.rld_tokens + s.md_tokens == n - 1
        k = s.handoff_at_token or n
        assert set(stages[1:k]) == {common_pb2.STAGE_RELAY}
        assert set(stages[k:]) <= {common_pb2.STAGE_MAIN_DECODE}
    await no_kv_held(vllm_stack, rid, timeout_s=20)
