"""The OpenAI API's per-request ``timeout``: the body's field (or ``X-Request-Timeout``) becomes
the request's deadline, handed to the gateway as a gRPC client's deadline is; past it the
request is cancelled and answered 504 (DEADLINE_EXCEEDED's HTTP code) with an OpenAI error."""

from __future__ import annotations

import json
import time

import pytest

from pdd.http.openai_convert import TIMEOUT_HEADER
from tests.unit import test_http_api
from tests.unit.test_http_api import ScriptedGateway, events, post

serve = test_http_api.serve  # the fixture: the HTTP face on a loopback port


class DeadlineGateway(ScriptedGateway):
    """Records the deadline each request was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadlines: list[float | None] = []

    async def generate(self, job, ending=None, deadline_s=None):
        self.deadlines.append(deadline_s)
        async for ev in super().generate(job, ending):
            yield ev


@pytest.mark.parametrize(
    "body, headers, want",
    [
        ({"timeout": 7.5}, {}, 7.5),
        ({"timeout": 3}, {}, 3.0),
        ({}, {TIMEOUT_HEADER: "12"}, 12.0),
        ({"timeout": 2}, {TIMEOUT_HEADER: "12"}, 2.0),  # the body's wins
        ({}, {}, None),
        ({"timeout": None}, {}, None),
    ],
)
async def test_the_timeout_is_the_deadline_every_stage_gets(serve, body, headers, want):
    gw = DeadlineGateway()
    url = await serve(gw)
    status, _, _ = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", **body}, headers
    )
    assert status == 200
    assert gw.deadlines == [want]


async def test_every_choice_gets_the_deadline(serve):
    gw = DeadlineGateway()
    url = await serve(gw)
    status, _, _ = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2, "timeout": 9}
    )
    assert status == 200 and gw.deadlines == [9.0] * 4


@pytest.mark.parametrize("n", [1, 2])
async def test_past_the_timeout_the_request_is_cancelled_and_answered_504(serve, n):
    gw = DeadlineGateway(text="x" * 50, delay_s=0.1)
    url = await serve(gw)
    t0 = time.monotonic()
    status, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 50, "timeout": 0.5, "n": n},
    )
    took = time.monotonic() - t0
    err = json.loads(text)["error"]
    assert status == 504 and err["type"] == "timeout_error"
    assert "timeout" in err["message"]
    # 50 tokens take 5 s; generous for a loaded machine, still far below that
    assert took < 3.0
    assert gw.ends == ["cancelled"] * n


async def test_a_streamed_request_past_its_timeout_ends_with_an_error_event(serve):
    gw = DeadlineGateway(text="x" * 50, delay_s=0.1)
    url = await serve(gw)
    status, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 50, "timeout": 0.6, "stream": True},
    )
    evs = events(text)
    assert status == 200
    assert 0 < len(evs) - 2 < 50  # some tokens came, then the error, then [DONE]
    assert evs[-2]["error"]["type"] == "timeout_error" and evs[-1] == "[DONE]"
    assert gw.ends == ["cancelled"]


async def test_a_timeout_that_does_not_pass_changes_nothing(serve):
    gw = DeadlineGateway(text="Hello")
    url = await serve(gw)
    status, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 5, "timeout": 30}
    )
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "Hello"
    assert gw.ends == ["finished"]


@pytest.mark.parametrize(
    "body, headers, param",
    [
        ({"timeout": -1}, {}, "timeout"),
        ({"timeout": 0}, {}, "timeout"),
        ({"timeout": "10"}, {}, "timeout"),
        ({"timeout": True}, {}, "timeout"),
        ({"timeout": [1]}, {}, "timeout"),
        ({"timeout": 1e12}, {}, "timeout"),
        ({}, {TIMEOUT_HEADER: "soon"}, TIMEOUT_HEADER),
        ({}, {TIMEOUT_HEADER: "-3"}, TIMEOUT_HEADER),
        ({}, {TIMEOUT_HEADER: "nan"}, TIMEOUT_HEADER),
        ({}, {TIMEOUT_HEADER: "inf"}, TIMEOUT_HEADER),
    ],
)
async def test_a_bad_timeout_is_400_naming_it(serve, body, headers, param):
    gw = DeadlineGateway()
    url = await serve(gw)
    status, _, text = await post(
        f"{url}/v1/completions", {"model": "m", "prompt": "hi", **body}, headers
    )
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert gw.jobs == []


async def test_nan_in_the_body_is_refused(serve):
    gw = DeadlineGateway()
    url = await serve(gw)
    # NOTE: Python's json accepts the NaN literal, so a client can send it
    status, _, text = await post(
        f"{url}/v1/completions", None, raw='{"model": "m", "prompt": "hi", "timeout": NaN}'
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "timeout"
