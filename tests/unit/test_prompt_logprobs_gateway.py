"""Prompt logprobs through the gateway's request life (in-process fake peers, no gRPC): only the
stage that computes the prompt is asked for them (prefill; MainDecode for pipeline MD), they come
out on the event carrying output position 0, and a stage that leaves them out fails the request.
"""

from __future__ import annotations

import pytest

from pdd.core.errors import FailedPreconditionError
from pdd.core.pipeline import Pipeline
from pdd.core.sampling_params import Logprob
from pdd.core.stage_events import Accepted, Finished, FirstToken, HandedOff, Tokens
from tests.unit.test_gateway_life import PROMPT, TRANSFER, FakePeers, flat, job, run

SCORES = tuple(Logprob(-0.25 * i, ((i, -0.1),), rank=2) for i in range(1, len(PROMPT)))


def scored_first(token_id: int = 20, scores=SCORES) -> FirstToken:
    return FirstToken(token_id, len(PROMPT), 0, 1.0, None, scores)


async def test_p_md_prefill_scores_the_prompt_and_output_0_carries_it():
    peers = FakePeers(
        md=[Accepted(4), Tokens(1, (21, 22)), Finished("length", 3, 2)],
        prefill=[scored_first(), TRANSFER],
    )
    tokens, _ = await run(peers, job(Pipeline.P_MD, prompt_logprobs=1))
    assert flat(tokens)[0] == [20, 21, 22]
    assert tokens[0].start_position == 0 and tokens[0].prompt_logprobs == SCORES
    assert all(ev.prompt_logprobs == () for ev in tokens[1:])
    # NOTE: MainDecode only receives the KV: asking it would bypass its DRC hit for nothing
    assert peers.jobs["prefill"].sampling.prompt_logprobs == 1
    assert peers.jobs["main_decode"].sampling.prompt_logprobs is None


async def test_p_rld_md_the_relay_is_not_asked_either():
    peers = FakePeers(
        md=[Accepted(0), Tokens(3, (23,)), Finished("length", 4, 1)],
        prefill=[scored_first(), TRANSFER],
        relay=[
            Accepted(),
            Tokens(1, (21, 22)),
            HandedOff(3, job(Pipeline.P_RLD_MD).handoff_mode, 1, 1.0),
        ],
    )
    tokens, _ = await run(peers, job(Pipeline.P_RLD_MD, prompt_logprobs=0))
    assert flat(tokens)[0] == [20, 21, 22, 23] and tokens[0].prompt_logprobs == SCORES
    assert peers.jobs["relay"].sampling.prompt_logprobs is None
    assert peers.jobs["main_decode"].sampling.prompt_logprobs is None


async def test_md_pipeline_main_decode_prefills_so_it_scores():
    peers = FakePeers(md=[Accepted(0), Tokens(0, (20, 21), (), SCORES), Finished("length", 2, 2)])
    tokens, _ = await run(peers, job(Pipeline.MD, prompt_logprobs=2))
    assert peers.jobs["main_decode"].sampling.prompt_logprobs == 2
    assert tokens[0].prompt_logprobs == SCORES


async def test_output_0_without_the_prompt_logprobs_fails_the_request():
    peers = FakePeers(
        md=[Accepted(0), Tokens(1, (21,)), Finished("length", 2, 1)],
        prefill=[scored_first(scores=()), TRANSFER],
    )
    with pytest.raises(FailedPreconditionError, match="without the prompt logprobs"):
        await run(peers, job(Pipeline.P_MD, prompt_logprobs=0))


async def test_a_request_without_prompt_logprobs_gets_none():
    peers = FakePeers(
        md=[Accepted(0), Tokens(1, (21,)), Finished("length", 2, 1)],
        prefill=[scored_first(), TRANSFER],  # NOTE: even if a stage sent some
    )
    tokens, _ = await run(peers, job(Pipeline.P_MD))
    assert all(ev.prompt_logprobs == () for ev in tokens)
