"""OpenAI JSON → GenerateJob (with the gRPC face's validation) and results → OpenAI JSON."""

from __future__ import annotations

import json
import math

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.sampling_params import Logprob
from pdd.http import openai_convert as conv
from pdd.http import openai_responses as responses
from pdd.http.chat_template import render_chat

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character: lengths are easy to reason about


INFO = ModelInfo(
    name="m",
    vocab_size=1000,
    max_context_tokens=200,
    eos_token_ids=(2,),
    chat_template=TEMPLATE,
    encode=encode,
)
NO_TOKENIZER = ModelInfo(name="tiny", vocab_size=300, max_context_tokens=64)


def completion(**body):
    return conv.completion_request({"model": "m", **body}, INFO, "rid-1")


def test_text_prompt_becomes_a_job_with_openai_defaults():
    r = completion(prompt="hi there")
    assert r.kind == conv.COMPLETION and r.model == "m" and not r.stream
    assert r.job.request_id == "rid-1" and r.id == "cmpl-rid-1"
    assert r.job.prompt_token_ids == tuple(encode("hi there"))
    assert r.job.sampling.max_tokens == 16  # OpenAI's default for completions
    assert r.job.sampling.temperature == 1.0 and r.job.sampling.top_p == 1.0
    assert r.job.sampling.seed is None


def test_token_prompt_and_sampling_fields():
    r = completion(
        prompt=[5, 6, 7],
        max_tokens=9,
        temperature=0,
        top_p=0.5,
        seed=42,
        stop=["\n"],
        stop_token_ids=[3],
        ignore_eos=True,
        top_k=-1,
        cache_salt="t1",
        stream=True,
        stream_options={"include_usage": True},
    )
    s = r.job.sampling
    assert r.job.prompt_token_ids == (5, 6, 7) and r.job.cache_salt == "t1"
    assert (
        s.max_tokens,
        s.temperature,
        s.top_p,
        s.seed,
        s.stop_token_ids,
        s.ignore_eos,
        s.top_k,
    ) == (9, 0.0, 0.5, 42, (3,), True, 0)
    assert r.stream and r.include_usage and r.stop == ("\n",)


def test_penalties_reach_the_job():
    s = completion(
        prompt="x", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.25
    ).job.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert completion(prompt="x", logit_bias={"50": -100, "7": 2.5}).job.sampling.logit_bias == (
        (7, 2.5),
        (50, -100.0),
    )
    chat = conv.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "frequency_penalty": 0.75,
        },
        INFO,
        "c",
    ).job.sampling
    assert (chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (
        0.0,
        0.75,
        1.0,
    )


def test_a_batch_of_one_prompt_is_unwrapped():
    assert completion(prompt=["ab"]).job.prompt_token_ids == tuple(encode("ab"))
    assert completion(prompt=[[4, 5]]).job.prompt_token_ids == (4, 5)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (dict(), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=["a", [1]]), "prompt"),  # a batch is all strings or all token-id lists
        (dict(prompt=["a", ""]), "prompt[1]"),
        (dict(prompt=[1, -2]), "prompt"),
        (dict(prompt=[1, 5000]), "prompt_token_ids[1]"),
        (dict(prompt=[1] * 200), "prompt_token_ids"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", max_tokens=-1), "max_tokens"),
        (dict(prompt="x", max_tokens=True), "max_tokens"),
        (dict(prompt="x", max_tokens=500), "max_tokens"),
        (dict(prompt="x", temperature="hot"), "temperature"),
        (dict(prompt="x", temperature=-0.5), "temperature"),
        (dict(prompt="x", temperature=math.nan), "temperature"),
        (dict(prompt="x", top_p=1.5), "top_p"),
        (dict(prompt="x", seed=-1), "seed"),
        (dict(prompt="x", n=0), "n"),
        (dict(prompt="x", n=conv.MAX_N + 1), "n"),
        (dict(prompt="x", n="2"), "n"),
        (dict(prompt="x", n=True), "n"),
        (dict(prompt="x", best_of=2), "best_of"),
        (dict(prompt="x", stop=[""]), "stop"),
        (dict(prompt="x", stop=7), "stop"),
        (dict(prompt="x", echo="yes"), "echo"),
        (dict(prompt="x", logprobs=21), "logprobs"),
        (dict(prompt="x", logprobs=True), "logprobs"),
        (dict(prompt="x", presence_penalty=2.5), "presence_penalty"),
        (dict(prompt="x", frequency_penalty="much"), "frequency_penalty"),
        (dict(prompt="x", frequency_penalty=-2.5), "frequency_penalty"),
        (dict(prompt="x", repetition_penalty=0), "repetition_penalty"),
        (dict(prompt="x", repetition_penalty=-1.0), "repetition_penalty"),
        (dict(prompt="x", response_format={"type": "xml"}), "response_format"),
        (dict(prompt="x", response_format="json"), "response_format"),
        (dict(prompt="x", response_format={"type": "json_schema"}), "response_format.json_schema"),
        (
            dict(
                prompt="x",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                },
            ),
            "response_format.json_schema.schema",
        ),
        (dict(prompt="x", logit_bias=[1, 2]), "logit_bias"),
        (dict(prompt="x", logit_bias={"a": 1}), "logit_bias"),
        (dict(prompt="x", logit_bias={"-1": 1}), "logit_bias"),
        (dict(prompt="x", logit_bias={"5": "up"}), "logit_bias[5]"),
        (dict(prompt="x", logit_bias={"5": 250}), "logit_bias[5]"),
        (dict(prompt="x", logit_bias={"4000": 1}), "logit_bias[4000]"),
        (dict(prompt="x", stream_options={"include_usage": True}), "stream_options"),
        (dict(prompt="x", stream="yes"), "stream"),
        (dict(prompt="x", cache_salt="has space"), "cache_salt"),
    ],
)
def test_bad_fields_are_invalid_arguments_naming_the_field(body, field):
    with pytest.raises(InvalidArgumentError) as err:
        completion(**body)
    assert err.value.field == field


def test_text_prompt_needs_a_tokenizer():
    with pytest.raises(InvalidArgumentError) as err:
        conv.completion_request({"model": "tiny", "prompt": "hello"}, NO_TOKENIZER, "r")
    assert err.value.field == "prompt"
    job = conv.completion_request({"model": "tiny", "prompt": [1, 2]}, NO_TOKENIZER, "r").job
    assert job.prompt_token_ids == (1, 2)


def test_chat_renders_the_template_with_the_generation_prompt():
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}],
        },
    ]
    assert render_chat(TEMPLATE, msgs) == "<system>be brief</s><user>hi you</s><assistant>"
    r = conv.chat_request({"model": "m", "messages": msgs, "max_completion_tokens": 5}, INFO, "c1")
    assert r.kind == conv.CHAT and r.id == "chatcmpl-c1"
    assert r.job.prompt_token_ids == tuple(
        encode("<system>be brief</s><user>hi you</s><assistant>")
    )
    assert r.job.sampling.max_tokens == 5


def test_chat_without_max_tokens_may_use_the_rest_of_the_context():
    r = conv.chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, INFO, "c2"
    )
    assert r.job.sampling.max_tokens == INFO.max_context_tokens - len(r.job.prompt_token_ids)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidArgumentError) as err:
        conv.chat_request({"model": "m", "messages": messages}, INFO, "c")
    assert err.value.field == field


def test_chat_needs_a_template_and_template_errors_are_bad_requests():
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        conv.chat_request(
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, NO_TOKENIZER, "c"
        )
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(InvalidArgumentError, match="first must be user"):
        render_chat(strict, [{"role": "assistant", "content": "x"}])


def test_response_shapes_match_openai():
    r = completion(prompt="x", return_token_ids=True)
    body = responses.response_body(r, [responses.Choice("hello", "length", [1, 2])], 3, 2)
    assert (
        body["object"] == "text_completion" and body["id"] == "cmpl-rid-1" and body["model"] == "m"
    )
    assert body["choices"] == [
        {
            "index": 0,
            "text": "hello",
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [1, 2],
        }
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

    c = conv.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        INFO,
        "c3",
    )
    first = responses.chunk_body(c, role=True)
    assert first["object"] == "chat.completion.chunk"
    assert (
        first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        and first["usage"] is None
    )
    assert responses.chunk_body(c, "4")["choices"][0]["delta"] == {"content": "4"}
    last = responses.chunk_body(c, "", "stop", ())
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert "token_ids" not in last["choices"][0]
    tail = responses.usage_chunk(c, 7, 1)
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 8
    whole = responses.response_body(
        conv.chat_request(
            {"model": "m", "messages": [{"role": "user", "content": "q"}]}, INFO, "c4"
        ),
        [responses.Choice("4", "stop", [9])],
        7,
        1,
    )
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "4"}


def test_n_choices_are_requests_of_their_own():
    one = completion(prompt="x", seed=5)
    assert one.n == 1 and one.choice_jobs() == [one.job]
    r = completion(prompt="x", n=3, seed=2**64 - 2, session_id="s", cache_salt="t")
    jobs = r.choice_jobs()
    assert [j.request_id for j in jobs] == [
        "rid-1-0",
        "rid-1-1",
        "rid-1-2",
    ] and r.id == "cmpl-rid-1"
    # vLLM's rule: choice i draws with seed + i (kept within the wire's uint64)
    assert [j.sampling.seed for j in jobs] == [2**64 - 2, 2**64 - 1, 0]
    assert all(
        j.prompt_token_ids == r.job.prompt_token_ids and (j.session_id, j.cache_salt) == ("s", "t")
        for j in jobs
    )
    assert all(
        j.sampling.seed is None for j in completion(prompt="x", n=2, temperature=1).choice_jobs()
    )
    long_id = conv.completion_request(
        {"model": "m", "prompt": "x", "n": 12}, INFO, "r" * 128
    ).choice_jobs()
    assert [len(j.request_id) for j in long_id] == [128] * 12 and len(
        {j.request_id for j in long_id}
    ) == 12
    body = responses.response_body(
        r, [responses.Choice("a", "stop", [1]), responses.Choice("bc", "length", [2, 3])], 1, 3
    )
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "bc")]
    assert responses.chunk_body(r, "z", index=2)["choices"][0]["index"] == 2


def test_finish_reasons_are_openai_ones():
    assert responses.finish_reason("length") == "length"
    assert responses.finish_reason("stop") == responses.finish_reason(None) == "stop"


def test_logprobs_requests_and_shapes():
    assert not completion(prompt="x").logprobs
    assert completion(prompt="x", logprobs=0).job.sampling.logprobs == 0
    r = completion(prompt="x", logprobs=2)
    assert r.logprobs and r.job.sampling.logprobs == 2
    items = [
        (104, Logprob(-0.25, ((104, -0.25), (105, -2.0)))),
        (105, Logprob(-3.0, ((104, -0.5), (106, -1.0)))),
    ]
    body = responses.logprobs_body(r, items, chr, text_offset=10)
    # completions: the sampled token is always among top_logprobs (up to k + 1 entries)
    assert body == {
        "tokens": ["h", "i"],
        "token_logprobs": [-0.25, -3.0],
        "top_logprobs": [{"h": -0.25, "i": -2.0}, {"h": -0.5, "j": -1.0, "i": -3.0}],
        "text_offset": [10, 11],
    }
    chat = conv.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 1,
        },
        INFO,
        "c",
    )
    assert chat.job.sampling.logprobs == 1
    assert responses.logprobs_body(chat, items[:1], chr) == {
        "content": [
            {
                "token": "h",
                "logprob": -0.25,
                "bytes": [104],
                "top_logprobs": [
                    {"token": "h", "logprob": -0.25, "bytes": [104]},
                    {"token": "i", "logprob": -2.0, "bytes": [105]},
                ],
            }
        ]
    }
    plain = conv.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 2,
            "logprobs": False,
        },
        INFO,
        "c",
    )
    assert not plain.logprobs
    with pytest.raises(InvalidArgumentError) as err:
        conv.chat_request(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 2,
                "top_logprobs": 3,
            },
            INFO,
            "c",
        )
    assert err.value.field == "top_logprobs"
    whole = responses.response_body(r, [responses.Choice("hi", "length", [104, 105], body)], 1, 2)
    assert whole["choices"][0]["logprobs"] == body
    assert responses.chunk_body(r, "h", logprobs=body)["choices"][0]["logprobs"] == body


def test_response_format_becomes_a_grammar():
    assert completion(prompt="x").job.sampling.grammar is None
    assert completion(prompt="x", response_format={"type": "text"}).job.sampling.grammar is None
    obj = completion(prompt="x", response_format={"type": "json_object"}).job.sampling.grammar
    assert json.loads(obj)["grammars"][0]["json_schema"]["type"] == "object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = conv.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "A", "schema": schema, "strict": True},
            },
        },
        INFO,
        "c",
    )
    assert json.loads(r.job.sampling.grammar)["grammars"][0]["json_schema"]["required"] == ["a"]
