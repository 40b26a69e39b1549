"""Sampling parameters and logprobs on the wire: the gateway's request, the stages' messages, the merge."""

from __future__ import annotations

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.pipeline import Stage
from pdd.core.request import TokenEvent
from pdd.core.sampling_params import Logprob, SamplingParams
from pdd.engine import grammar
from pdd.gen.common.v1 import common_pb2
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.serving.token_merge import TokenMerge
from pdd.wire.common import (
    logprob_from_pb,
    logprob_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    stage_from_pb,
    stage_to_pb,
)
from pdd.wire.gateway import event_to_pb, generate_from_pb

INFO = ModelInfo("m", vocab_size=100, max_context_tokens=64)


def request(**fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_tokens=4, **fields)
    req.prompt_token_ids.token_ids.extend([1, 2, 3])
    return req


def test_penalties_cross_the_gateway_and_every_stage_hop():
    job = generate_from_pb(
        request(presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.5), INFO
    )
    sp = job.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.25, 1.5)
    assert sampling_from_pb(sampling_to_pb(sp)) == sp
    # float32 on the wire: what the gateway accepted is what every stage's engine gets
    odd = generate_from_pb(request(repetition_penalty=1.3), INFO).sampling
    assert sampling_from_pb(sampling_to_pb(odd)) == odd and odd.repetition_penalty == pytest.approx(
        1.3
    )


def test_unset_penalties_are_off():
    sp = generate_from_pb(request(), INFO).sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not sp.adjusts_logits
    assert sampling_from_pb(common_pb2.SamplingParams(max_tokens=3)).repetition_penalty == 1.0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=-0.5), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logit_bias={7: 101.0}), "logit_bias[7]"),
    ],
)
def test_bad_penalties_name_their_field(fields, field):
    with pytest.raises(InvalidArgumentError) as err:
        generate_from_pb(request(**fields), INFO)
    assert err.value.field == field
    stage = common_pb2.SamplingParams(max_tokens=3, **fields)
    with pytest.raises(InvalidArgumentError) as err:
        sampling_from_pb(stage)
    assert err.value.field == f"sampling.{field}"


def test_sampling_params_round_trip_keeps_every_field():
    sp = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        seed=3,
        stop_token_ids=(4, 5),
        ignore_eos=True,
        presence_penalty=0.25,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias={8: -100.0, 3: 2.5},
    )
    assert sampling_from_pb(sampling_to_pb(sp)) == sp


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    req = request()
    req.logit_bias[99] = 1.0
    assert generate_from_pb(req, INFO).sampling.logit_bias == ((99, 1.0),)
    req.logit_bias[100] = 1.0
    with pytest.raises(InvalidArgumentError) as err:
        generate_from_pb(req, INFO)
    assert err.value.field == "logit_bias[100]"


def test_logprobs_request_and_values_on_the_wire():
    assert generate_from_pb(request(), INFO).sampling.logprobs is None
    assert generate_from_pb(request(logprobs=0), INFO).sampling.logprobs == 0
    sp = generate_from_pb(request(logprobs=5), INFO).sampling
    assert sp.logprobs == 5 and sampling_from_pb(sampling_to_pb(sp)) == sp
    with pytest.raises(InvalidArgumentError) as err:
        generate_from_pb(request(logprobs=21), INFO)
    assert err.value.field == "logprobs"
    lp = Logprob(-0.5, ((3, -0.5), (9, -1.25)))
    assert logprob_from_pb(logprob_to_pb(lp)) == lp and logprob_from_pb(
        logprob_to_pb(Logprob(-2.0))
    ) == Logprob(-2.0)


def test_merged_stream_keeps_each_tokens_logprob_whichever_stage_sent_it():
    """The gateway's merge: out-of-order deltas, an overlap two stages both sent, stages grouped."""
    lp = {pos: Logprob(-float(pos)) for pos in range(6)}
    merge = TokenMerge()
    assert merge.add(0, [10], Stage.PREFILL, [lp[0]]) == [
        TokenEvent(0, (10,), Stage.PREFILL, (lp[0],))
    ]
    # ahead of the relay: held
    assert merge.add(3, [13, 14], Stage.MAIN_DECODE, [lp[3], lp[4]]) == []
    out = merge.add(
        1, [11, 12, 99], Stage.RELAY, [lp[1], lp[2], Logprob(-9.0)]
    )  # 99 at 3: MainDecode's 13 came first
    assert out == [
        TokenEvent(1, (11, 12), Stage.RELAY, (lp[1], lp[2])),
        TokenEvent(3, (13, 14), Stage.MAIN_DECODE, (lp[3], lp[4])),
    ]
    # not asked for: none
    assert merge.add(5, [15], Stage.MAIN_DECODE) == [TokenEvent(5, (15,), Stage.MAIN_DECODE)]


def test_a_token_events_stage_crosses_the_gateways_wire():
    assert [stage_to_pb(s) for s in Stage] == [
        common_pb2.STAGE_PREFILL,
        common_pb2.STAGE_RELAY,
        common_pb2.STAGE_MAIN_DECODE,
    ]
    assert all(stage_from_pb(stage_to_pb(s)) is s for s in Stage)
    assert stage_from_pb(common_pb2.STAGE_UNSPECIFIED) is None
    with pytest.raises(InvalidArgumentError):
        stage_from_pb(99)
    msg = event_to_pb(TokenEvent(3, (7, 8), Stage.MAIN_DECODE), "r-1")
    assert (msg.stage, msg.start_position, list(msg.token_ids)) == (
        common_pb2.STAGE_MAIN_DECODE,
        3,
        [7, 8],
    )


def test_grammar_is_checked_by_the_gateway_and_crosses_every_hop():
    with_tokenizer = ModelInfo("m", vocab_size=100, max_context_tokens=64, encode=lambda s: [1])
    g = grammar.from_json_schema({"type": "object"})
    sp = generate_from_pb(request(grammar=g), with_tokenizer).sampling
    assert sp.grammar == g and sampling_from_pb(sampling_to_pb(sp)) == sp
    assert generate_from_pb(request(), with_tokenizer).sampling.grammar is None
    for info, bad, says in (
        (with_tokenizer, '{"grammars": [{"json_schema": {"type": 7}}]}', "does not compile"),
        (INFO, g, "no tokenizer"),
    ):
        with pytest.raises(InvalidArgumentError) as err:
            generate_from_pb(request(grammar=bad), info)
        assert err.value.field == "grammar" and says in err.value.description
