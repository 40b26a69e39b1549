"""Batched prompts, echo and prompt logprobs on the HTTP face, over a scripted request life.

The thing under test is ``OpenAIServer`` + ``openai_convert``: choice indexing (prompt * n + j),
usage summed, streamed chunks tagged by index, echo's text and logprobs (OpenAI's shape, the first
prompt token null), echo without generation, vLLM's ``prompt_logprobs``, the router-override
headers, and 400s naming the field. ``EchoGateway`` plays back each prompt's reversed tokens as
the output and scores the prompt the way the engine reports it (one Logprob per token after
the first, on output position 0).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdd.core.pipeline import HandoffMode, Pipeline, Stage
from pdd.core.request import FinalEvent, RequestStats, TokenEvent
from pdd.core.sampling_params import Logprob
from pdd.http.config import HttpConfig
from pdd.http.openai_api import OpenAIServer
from tests.unit.test_http_api import INFO, decode, events, post
from tests.unit.test_http_convert import TEMPLATE

CHAT_INFO = replace(INFO, chat_template=TEMPLATE)


def score(position: int, token: int) -> Logprob:
    """What the scripted model says of prompt token ``position`` (>= 1): exact in float32."""
    return Logprob(-position / 4, ((token, -position / 4), (ord("?"), -8.0)), rank=1)


def out_logprob(token: int) -> Logprob:
    return Logprob(-0.5, ((token, -0.5), (ord("!"), -3.0)))


class EchoGateway:
    def __init__(self) -> None:
        self.jobs = []

    async def generate(self, job, ending=None, deadline_s=None):
        self.jobs.append(job)
        sp, prompt = job.sampling, job.prompt_token_ids
        output = list(reversed(prompt))[: sp.max_tokens]
        for i, tok in enumerate(output):
            lps = () if sp.logprobs is None else (_top(out_logprob(tok), sp.logprobs),)
            scores = ()
            if i == 0 and sp.prompt_logprobs is not None:
                scores = tuple(
                    _top(score(p, t), sp.prompt_logprobs) for p, t in enumerate(prompt) if p
                )
            yield TokenEvent(i, (tok,), Stage.MAIN_DECODE, lps, scores)
        yield FinalEvent(
            "length", RequestStats(prompt_tokens=len(prompt), completion_tokens=len(output))
        )

    async def instances(self):
        return []


def _top(lp: Logprob, k: int) -> Logprob:
    return Logprob(lp.logprob, lp.top[:k], lp.rank)


@pytest.fixture
async def url():
    gw = EchoGateway()
    server = OpenAIServer(gw, CHAT_INFO, decode, HttpConfig(port=0))
    await server.start()
    yield f"http://127.0.0.1:{server.port}", gw
    await server.stop()


async def completions(base, body, headers=None):
    status, _, text = await post(f"{base}/v1/completions", {"model": "m", **body}, headers)
    return status, (json.loads(text) if not body.get("stream") or status != 200 else text)


async def test_a_batch_of_strings_indexes_choices_prompt_major_and_sums_usage(url):
    base, gw = url
    status, body = await completions(
        base, {"prompt": ["abc", "xy"], "max_tokens": 2, "n": 2, "seed": 5}
    )
    assert status == 200
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "cb"),
        (1, "cb"),
        (2, "yx"),
        (3, "yx"),
    ]
    # prompt tokens once per prompt, completion tokens over every choice
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    # choice j of each prompt draws with seed + j; every request life has its own id
    assert [j.sampling.seed for j in gw.jobs] == [5, 6, 5, 6]
    assert len({j.request_id for j in gw.jobs}) == 4


async def test_a_batch_of_token_id_lists_streams_chunks_tagged_by_index(url):
    base, _ = url
    status, text = await completions(
        base,
        {
            "prompt": [[104, 105], [111, 107, 33]],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    evs = events(text)
    assert status == 200 and evs[-1] == "[DONE]"
    by_index: dict[int, str] = {}
    finished = []
    for ev in evs[:-2]:
        (choice,) = ev["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished.append(choice["index"])
    assert by_index == {0: "ih", 1: "!ko"} and sorted(finished) == [0, 1]
    assert evs[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


async def test_what_lm_eval_sends_for_loglikelihood(url):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request, exactly: a batch of
    token-id lists, echo, max_tokens 1, logprobs 1; it then reads token_logprobs[ctxlen:-1]."""
    base, _ = url
    prompts = [[72, 105, 32, 116], [72, 111]]
    body = {
        "model": "m",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, _, text = await post(f"{base}/v1/completions", body)
    out = json.loads(text)
    assert status == 200
    for choice, prompt in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        # the prompt's tokens, then the generated one
        assert lp["tokens"] == [decode([t]) for t in prompt] + [decode([prompt[-1]])]
        assert lp["token_logprobs"] == [None] + [-p / 4 for p in range(1, len(prompt))] + [-0.5]
        assert lp["top_logprobs"][0] is None
        assert lp["top_logprobs"][1] == {decode([prompt[1]]): -0.25}
        assert lp["text_offset"] == list(range(len(prompt) + 1))
        assert choice["text"] == decode(prompt) + decode([prompt[-1]])
        ctxlen = 1
        continuation = lp["token_logprobs"][ctxlen:-1]
        assert sum(continuation) == sum(-p / 4 for p in range(1, len(prompt)))
        is_greedy = all(
            t == max(top.values()) for t, top in zip(continuation, lp["top_logprobs"][ctxlen:-1])
        )
        assert is_greedy
    assert out["usage"]["completion_tokens"] == 2


async def test_echo_with_max_tokens_0_returns_the_prompt_alone(url):
    base, gw = url
    status, body = await completions(
        base, {"prompt": "hey", "max_tokens": 0, "echo": True, "logprobs": 0}
    )
    (choice,) = body["choices"]
    assert status == 200 and choice["text"] == "hey" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "e", "y"] and lp["token_logprobs"] == [None, -0.25, -0.5]
    assert lp["top_logprobs"] == [None, {"e": -0.25}, {"y": -0.5}]  # logprobs 0: the token only
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    # one token is generated (and dropped) so output 0 carries the prompt's scores
    assert gw.jobs[0].sampling.max_tokens == 1 and gw.jobs[0].sampling.prompt_logprobs == 0


async def test_echo_without_logprobs_prefixes_the_text(url):
    base, gw = url
    status, body = await completions(base, {"prompt": [104, 105], "max_tokens": 1, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == "hii"
    assert body["choices"][0]["logprobs"] is None
    assert gw.jobs[0].sampling.prompt_logprobs is None  # nothing to score


async def test_echo_streamed_sends_the_prompt_first(url):
    base, _ = url
    status, text = await completions(
        base, {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    )
    evs = events(text)
    assert status == 200
    first = evs[0]["choices"][0]
    assert first["text"] == "abc"
    assert first["logprobs"]["token_logprobs"] == [None, -0.25, -0.5]
    assert first["logprobs"]["text_offset"] == [0, 1, 2]
    second = evs[1]["choices"][0]
    assert second["text"] == "c" and second["logprobs"]["text_offset"] == [3]
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "abccb"


async def test_vllm_prompt_logprobs(url):
    base, gw = url
    status, body = await completions(
        base, {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 1, "logprobs": 0}
    )
    (choice,) = body["choices"]
    assert status == 200 and choice["text"] == "c"
    assert choice["prompt_logprobs"] == [
        None,
        {str(ord("b")): {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
        {str(ord("c")): {"logprob": -0.5, "rank": 1, "decoded_token": "c"}},
    ]
    # not echoed: the choice's logprobs are the output's only
    assert choice["logprobs"]["token_logprobs"] == [-0.5]
    assert gw.jobs[0].sampling.prompt_logprobs == 1


async def test_echo_and_prompt_logprobs_share_one_scoring_with_their_own_top_k(url):
    base, gw = url
    status, body = await completions(
        base, {"prompt": "ab", "max_tokens": 1, "echo": True, "logprobs": 0, "prompt_logprobs": 2}
    )
    (choice,) = body["choices"]
    assert gw.jobs[0].sampling.prompt_logprobs == 2
    assert choice["logprobs"]["top_logprobs"][1] == {"b": -0.25}  # logprobs 0
    assert set(choice["prompt_logprobs"][1]) == {str(ord("b")), str(ord("?"))}  # the top 2


async def test_chat_takes_prompt_logprobs_too(url):
    base, gw = url
    status, _, text = await post(
        f"{base}/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    )
    body = json.loads(text)
    prompt = gw.jobs[0].prompt_token_ids
    assert status == 200 and len(body["choices"][0]["prompt_logprobs"]) == len(prompt)
    assert body["choices"][0]["prompt_logprobs"][1] == {
        str(prompt[1]): {"logprob": -0.25, "rank": 1, "decoded_token": decode([prompt[1]])}
    }


async def test_the_router_override_headers_force_every_job(url):
    base, gw = url
    status, _ = await completions(
        base,
        {"prompt": ["a", "b"], "max_tokens": 1},
        {"X-PDD-Pipeline": "P-RLD-MD", "X-PDD-Handoff-Mode": "catch-up"},
    )
    assert status == 200
    assert {(j.force_pipeline, j.handoff_mode) for j in gw.jobs} == {
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP)
    }


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"prompt": ["a", ""]}, None, "prompt[1]"),
        ({"prompt": ["a", [1]]}, None, "prompt"),
        ({"prompt": [[1], []]}, None, "prompt[1]"),
        ({"prompt": [[1], [1, -5]]}, None, "prompt[1]"),
        ({"prompt": [[1], [1, 5000]]}, None, "prompt[1]"),  # outside the vocabulary
        ({"prompt": ["a"] * 257}, None, "prompt"),
        ({"prompt": "a", "prompt_logprobs": 21}, None, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, None, "prompt_logprobs"),
        ({"prompt": "a", "echo": 1}, None, "echo"),
        ({"prompt": "a", "max_tokens": 0}, None, "max_tokens"),  # 0 only with echo
        ({"prompt": "a"}, {"X-PDD-Pipeline": "p-rld"}, "X-PDD-Pipeline"),
        ({"prompt": "a"}, {"X-PDD-Handoff-Mode": "fast"}, "X-PDD-Handoff-Mode"),
    ],
)
async def test_bad_input_is_400_naming_the_field(url, body, headers, param):
    base, gw = url
    status, out = await completions(base, body, headers)
    assert status == 400 and out["error"]["param"] == param, out
    assert not gw.jobs


async def test_chat_refuses_echo(url):
    base, _ = url
    status, _, text = await post(
        f"{base}/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True},
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "echo"
