"""Prompt logprobs on the wire: the request field, each hop's events, the gateway's response."""

from __future__ import annotations

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.pipeline import Stage
from pdd.core.request import TokenEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.core.stage_events import FirstToken, Tokens
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.wire import main_decode as md_wire
from pdd.wire import prefill as prefill_wire
from pdd.wire.common import logprob_from_pb, logprob_to_pb, sampling_from_pb, sampling_to_pb
from pdd.wire.gateway import event_to_pb, generate_from_pb

INFO = ModelInfo("m", vocab_size=100, max_context_tokens=64)
# NOTE: values a float32 holds exactly, so the round trip is exact
SCORES = (Logprob(-0.5, ((7, -0.25), (3, -1.5)), rank=2), Logprob(-2.0, (), rank=9))


def request(**fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_tokens=4, **fields)
    req.prompt_token_ids.token_ids.extend([1, 2, 3])
    return req


def test_the_request_field_reaches_every_stage_message():
    job = generate_from_pb(request(prompt_logprobs=3), INFO)
    assert job.sampling.prompt_logprobs == 3
    assert generate_from_pb(request(), INFO).sampling.prompt_logprobs is None
    assert generate_from_pb(request(prompt_logprobs=0), INFO).sampling.prompt_logprobs == 0
    for sp in (job.sampling, SamplingParams()):
        assert sampling_from_pb(sampling_to_pb(sp)) == sp
    with pytest.raises(InvalidArgumentError) as err:
        generate_from_pb(request(prompt_logprobs=21), INFO)
    assert err.value.field == "prompt_logprobs"


def test_rank_round_trips_and_zero_means_not_computed():
    for lp in (*SCORES, Logprob(-1.0, ((1, -1.0),))):
        assert logprob_from_pb(logprob_to_pb(lp)) == lp


def test_prefill_and_main_decode_events_carry_them():
    first = FirstToken(9, 3, 0, 1.5, Logprob(-0.5), SCORES)
    assert prefill_wire.event_from_pb(prefill_wire.event_to_pb(first)) == first
    plain = FirstToken(9, 3, 0, 1.5)
    assert prefill_wire.event_from_pb(prefill_wire.event_to_pb(plain)) == plain
    tokens = Tokens(0, (9,), (), SCORES)
    assert md_wire.event_from_pb(md_wire.event_to_pb(tokens, "md-0")) == tokens


def test_the_gateway_response_carries_them_on_output_0():
    msg = event_to_pb(TokenEvent(0, (9,), Stage.PREFILL, (), SCORES), "r")
    assert [logprob_from_pb(m) for m in msg.prompt_logprobs] == list(SCORES)
    assert not event_to_pb(TokenEvent(1, (9,), Stage.MAIN_DECODE), "r").prompt_logprobs
