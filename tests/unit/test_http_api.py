"""The HTTP face on a loopback port, over a scripted request life.

The thing under test is ``OpenAIServer`` (routing, auth, limits, SSE, error
mapping); ``ScriptedGateway`` stands in for the domain below it and plays
back fixed token events, recording how each request ended.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

from pdd.core.errors import PeerError, ResourceExhaustedError, UnavailableError
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.core.model_info import ModelInfo
from pdd.core.pipeline import Stage
from pdd.core.request import FinalEvent, RequestStats, TokenEvent
from pdd.core.sampling_params import Logprob
from pdd.http.config import HttpConfig
from pdd.http.openai_api import OpenAIServer

INFO = ModelInfo(
    name="m",
    vocab_size=300,
    max_context_tokens=100,
    chat_template="",
    encode=lambda s: [ord(c) for c in s],
)


def decode(ids):
    return "".join(chr(i) for i in ids)


class ScriptedGateway:
    def __init__(
        self,
        text: str = "Hello world",
        *,
        fail_before: BaseException | None = None,
        fail_after: int | None = None,
        delay_s: float = 0.0,
        roles: tuple[Role, ...] = (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE),
        texts: dict[str, str] | None = None,
        fail_ids: tuple[str, ...] | None = None,
    ) -> None:
        self.text, self.fail_before, self.fail_after, self.delay_s, self.roles = (
            text,
            fail_before,
            fail_after,
            delay_s,
            roles,
        )
        self.texts = texts or {}  # request_id → its text, instead of ``text``
        self.fail_ids = fail_ids  # which requests ``fail_before`` hits (None: every one)
        self.jobs, self.ends = [], []

    async def generate(self, job, ending=None, deadline_s=None):
        self.jobs.append(job)
        end = "cancelled"
        text = self.texts.get(job.request_id, self.text)
        try:
            if self.fail_before is not None and (
                self.fail_ids is None or job.request_id in self.fail_ids
            ):
                raise self.fail_before
            for i, ch in enumerate(text[: job.sampling.max_tokens]):
                if i == self.fail_after:
                    raise UnavailableError("relay went away")
                await asyncio.sleep(self.delay_s)
                k = job.sampling.logprobs
                lps = (
                    ()
                    if k is None
                    else (Logprob(-i / 8, ((ord(ch), -i / 8), (ord("?"), -5.0))[:k]),)
                )
                yield TokenEvent(i, (ord(ch),), Stage.RELAY, lps)
            n = min(len(text), job.sampling.max_tokens)
            end = "finished"
            yield FinalEvent(
                "length" if n == job.sampling.max_tokens else "stop",
                RequestStats(prompt_tokens=len(job.prompt_token_ids), completion_tokens=n),
            )
        finally:
            self.ends.append(end)

    async def instances(self):
        return [Instance(InstanceRef(f"{r.value}-0", "127.0.0.1:1", r), 16) for r in self.roles]


@pytest.fixture
async def serve():
    servers = []

    async def start(gateway, info=INFO, **config):
        server = OpenAIServer(gateway, info, decode, HttpConfig(port=0, **config))
        await server.start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}"

    yield start
    for s in servers:
        await s.stop()


async def post(url, body, headers=None, raw=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url, data=raw if raw is not None else json.dumps(body), headers=headers or {}
        ) as r:
            return r.status, r.headers, await r.text()


def events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_completion_whole_and_request_id_header(serve):
    url = await serve(ScriptedGateway())
    status, headers, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 5},
        {"X-Request-Id": "my-req-1"},
    )
    body = json.loads(text)
    assert status == 200 and headers["x-request-id"] == "my-req-1"
    assert body["id"] == "cmpl-my-req-1" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


async def test_completion_stream_ends_with_usage_and_done(serve):
    gw = ScriptedGateway()
    url = await serve(gw)
    status, headers, text = await post(
        f"{url}/v1/completions",
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 50,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    evs = events(text)
    assert evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-2]) == "Hello world"
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 11
    assert gw.ends == ["finished"]


async def test_n_choices_whole(serve):
    gw = ScriptedGateway(texts={"r-0": "Red", "r-1": "Green!", "r-2": "Blue"}, delay_s=0.001)
    url = await serve(gw)
    status, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 5, "n": 3, "seed": 10},
        {"X-Request-Id": "r"},
    )
    body = json.loads(text)
    assert status == 200 and body["id"] == "cmpl-r"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Red", "stop"),
        (1, "Green", "length"),
        (2, "Blue", "stop"),
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}
    assert sorted((j.request_id, j.sampling.seed) for j in gw.jobs) == [
        ("r-0", 10),
        ("r-1", 11),
        ("r-2", 12),
    ]
    assert gw.ends == ["finished"] * 3


async def test_n_choices_streamed_chat(serve):
    gw = ScriptedGateway(texts={"c-0": "abc", "c-1": "defgh"}, delay_s=0.002)
    url = await serve(
        gw, replace(INFO, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    )
    _, _, text = await post(
        f"{url}/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 8,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"X-Request-Id": "c"},
    )
    evs = events(text)
    assert (
        evs[-1] == "[DONE]"
        and evs[-2]["choices"] == []
        and evs[-2]["usage"]["completion_tokens"] == 8
    )
    chunks = [e["choices"][0] for e in evs[:-2]]
    assert [c["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["index"] for c in chunks[:2]] == [0, 1]
    for index, want in ((0, "abc"), (1, "defgh")):
        mine = [c for c in chunks[2:] if c["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == want
        assert [c["finish_reason"] for c in mine if c["finish_reason"] is not None] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in evs[:-2])  # usage once, after every choice ended


async def test_a_failing_choice_fails_the_request_and_cancels_the_others(serve):
    gw = ScriptedGateway(
        fail_ids=("f-1",), fail_before=UnavailableError("no prefill"), delay_s=0.01
    )
    url = await serve(gw)
    status, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 50, "n": 3},
        {"X-Request-Id": "f"},
    )
    assert status == 503 and "no prefill" in json.loads(text)["error"]["message"]
    for _ in range(500):
        if len(gw.ends) == 3:
            break
        await asyncio.sleep(0.02)
    assert sorted(gw.ends) == ["cancelled"] * 3  # the failed one and the two it took down


async def test_logprobs_whole_and_streamed(serve):
    url = await serve(ScriptedGateway(text="Hey"))
    _, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 1}
    )
    lp = json.loads(text)["choices"][0]["logprobs"]
    assert lp == {
        "tokens": ["H", "e", "y"],
        "token_logprobs": [0.0, -0.125, -0.25],
        "top_logprobs": [{"H": 0.0}, {"e": -0.125}, {"y": -0.25}],
        "text_offset": [0, 1, 2],
    }
    _, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 2, "stream": True},
    )
    chunks = [e["choices"][0]["logprobs"] for e in events(text)[:-1] if e["choices"][0]["text"]]
    assert [c["text_offset"] for c in chunks] == [[0], [1], [2]]  # offsets run on over the chunks
    assert chunks[1]["top_logprobs"] == [{"e": -0.125, "?": -5.0}]
    _, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}
    )
    assert json.loads(text)["choices"][0]["logprobs"] is None


async def test_stop_string_cuts_the_text_and_ends_the_request_early(serve):
    gw = ScriptedGateway()
    url = await serve(gw)
    _, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 50, "stop": [" wor"]}
    )
    body = json.loads(text)
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 9  # tokens produced until " wor" was seen
    assert gw.ends == ["cancelled"]  # the rest was never generated


async def test_api_keys_guard_v1_only(serve):
    url = await serve(ScriptedGateway(), api_keys=("sk-a", "sk-b"))
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-a"}):
        status, _, text = await post(f"{url}/v1/completions", body, headers)
        assert status == 401, headers
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
    status, _, _ = await post(f"{url}/v1/completions", body, {"Authorization": "Bearer sk-b"})
    assert status == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/health") as r:
            assert r.status == 200
        async with s.get(f"{url}/v1/models") as r:
            assert r.status == 401


@pytest.mark.parametrize(
    ("raw", "status", "param", "code"),
    [
        ("{not json", 400, None, "invalid_json"),
        ("[1, 2]", 400, "body", None),
        ('{"prompt": "hi"}', 400, "model", None),
        ('{"model": "gpt-4", "prompt": "hi"}', 404, "model", "model_not_found"),
        ('{"model": "m", "prompt": "hi", "n": 17}', 400, "n", None),
        ('{"model": "m", "prompt": "hi", "max_tokens": 1000}', 400, "max_tokens", None),
    ],
)
async def test_bad_requests_get_openai_errors(serve, raw, status, param, code):
    gw = ScriptedGateway()
    url = await serve(gw)
    got, _, text = await post(f"{url}/v1/completions", None, raw=raw)
    err = json.loads(text)["error"]
    assert got == status
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert err["message"]
    assert gw.jobs == []


async def test_body_size_limit_is_413(serve):
    url = await serve(ScriptedGateway(), max_body_bytes=4096)
    status, _, text = await post(f"{url}/v1/completions", {"model": "m", "prompt": "x" * 10_000})
    assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"


async def test_unknown_route_and_method_are_json_errors(serve):
    url = await serve(ScriptedGateway())
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/nothing") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with s.get(f"{url}/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()


async def test_failure_before_the_first_token_keeps_its_status_even_when_streaming(serve):
    url = await serve(ScriptedGateway(fail_before=UnavailableError("no main_decode registered")))
    status, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "stream": True}
    )
    assert status == 503
    assert json.loads(text)["error"] == {
        "message": "no main_decode registered",
        "type": "service_unavailable_error",
        "param": None,
        "code": None,
    }


async def test_failure_mid_stream_is_an_error_event_then_done(serve):
    url = await serve(ScriptedGateway(fail_after=3))
    status, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "stream": True}
    )
    evs = events(text)
    assert status == 200
    assert "".join(e["choices"][0]["text"] for e in evs[:3]) == "Hel"
    assert evs[3]["error"]["type"] == "service_unavailable_error" and evs[4] == "[DONE]"


@pytest.mark.parametrize("n", [1, 2])
async def test_client_going_away_cancels_the_request(serve, n):
    gw = ScriptedGateway(text="x" * 50, delay_s=0.02)
    url = await serve(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": n},
        ) as r:
            await r.content.readline()
    for _ in range(
        500
    ):  # the server notices on its next write (every 20 ms); 10 s for a loaded machine
        if len(gw.ends) == n:
            break
        await asyncio.sleep(0.02)
    assert gw.ends == ["cancelled"] * n


async def test_ready_needs_prefill_and_main_decode(serve):
    ready = await serve(ScriptedGateway(roles=(Role.PREFILL, Role.MAIN_DECODE)))
    not_ready = await serve(ScriptedGateway(roles=(Role.PREFILL, Role.RELAY)))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{ready}/ready") as r:
            assert r.status == 200 and (await r.json())["status"] == "ready"
        async with s.get(f"{not_ready}/ready") as r:
            body = await r.json()
            assert r.status == 503 and body["missing"] == ["main_decode"]


async def test_models_and_metrics(serve):
    url = await serve(ScriptedGateway(), served_model_name="pdd-model")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            data = (await r.json())["data"]
            assert [m["id"] for m in data] == ["pdd-model"] and data[0]["max_model_len"] == 100
        async with s.get(f"{url}/v1/models/pdd-model") as r:
            assert r.status == 200
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert 'pdd_http_requests_total{code="200",route="/v1/models"}' in text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "refusal",
    [ResourceExhaustedError("gateway is full"), PeerError("RESOURCE_EXHAUSTED", "relay is full")],
    ids=["gateway", "stage"],
)
async def test_a_refusal_for_load_is_429_with_retry_after(serve, refusal, stream):
    url = await serve(ScriptedGateway(fail_before=refusal))
    status, headers, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "stream": stream}
    )
    assert status == 429 and headers["Retry-After"] == "1"
    assert json.loads(text)["error"]["type"] == "rate_limit_error"
    # other errors carry no Retry-After
    url = await serve(ScriptedGateway(fail_before=UnavailableError("no main_decode registered")))
    status, headers, _ = await post(f"{url}/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 503 and "Retry-After" not in headers
