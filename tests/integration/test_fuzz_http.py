"""Hostile input on the OpenAI API: the aiohttp app in process (the real converter, routes,
limits and error mapping; a scripted request life below it), driven by hypothesis with random
JSON, every documented field (``pdd.http.openapi``) with random values of any type, absurd
sampling parameters, huge repeated fields, invalid UTF-8 and oversized bodies.

Every answer is a clear status — 200, or 400/404/413/504 with an OpenAI error body, a 400
naming the field (``param``) or the body's fault (``code``) — never a 500, never a hang;
afterwards the app still serves a reference request. The count of cases run is printed and has a floor.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.core.model_info import ModelInfo
from pdd.http import openapi
from pdd.http.config import HttpConfig
from pdd.http.openai_api import OpenAIServer
from tests.unit.test_http_api import ScriptedGateway, decode

INFO = ModelInfo(
    name="m",
    vocab_size=300,
    max_context_tokens=100,
    chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    encode=lambda s: [ord(c) % 300 for c in s],
)
MAX_BODY = 64 * 1024
EXAMPLES = 150
CALL_TIMEOUT_S = 10.0

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)
# Absurd but typed values a fuzzer finds first: edges of every numeric range, huge lists.
ABSURD = st.one_of(
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, -(2**63), 1e308, -1e308, 1e-320]),
    st.lists(st.integers(0, 2**33), min_size=0, max_size=2000),
    st.lists(st.text(max_size=3), max_size=300),
    st.text(min_size=1000, max_size=5000),
)


def _field_bodies(fields: dict) -> st.SearchStrategy[dict]:
    values = st.one_of(JSON, ABSURD)
    return st.fixed_dictionaries(
        {"model": st.just("m")}, optional={name: values for name in fields if name != "model"}
    )


BODIES = st.one_of(
    _field_bodies(openapi.COMPLETION_FIELDS).map(lambda b: ("/v1/completions", b)),
    _field_bodies(openapi.CHAT_FIELDS).map(lambda b: ("/v1/chat/completions", b)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JSON),
)
RAW = st.one_of(
    st.binary(max_size=512),  # invalid UTF-8, not JSON
    st.binary(max_size=64).map(lambda b: b'{"model": "m", "prompt": "' + b + b'"}'),
    st.integers(MAX_BODY + 1, 2 * MAX_BODY).map(lambda n: b"{" + b" " * n + b"}"),  # oversized
    st.integers(1, 50).map(lambda n: b"[" * n * 200 + b"]" * n * 200),  # deeply nested
)


@pytest.fixture(scope="module")
def app():
    loop = asyncio.new_event_loop()
    gateway = ScriptedGateway(text="Hello world")
    server = OpenAIServer(gateway, INFO, decode, HttpConfig(port=0, max_body_bytes=MAX_BODY))
    loop.run_until_complete(server.start())
    session = loop.run_until_complete(_session())
    yield loop, f"http://127.0.0.1:{server.port}", session, gateway
    loop.run_until_complete(session.close())
    loop.run_until_complete(server.stop())
    loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))


async def _post(session, url: str, data: bytes) -> tuple[int, str]:
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.text()


def _check(status: int, text: str) -> str | None:
    """What is wrong with the answer (None: a clear one)."""
    if status == 200:
        return None
    if status not in (400, 404, 413, 504):  # 504: a tiny random `timeout` that passed
        return f"status {status}"
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return "not an OpenAI error body"
    if not err.get("message"):
        return "no message"
    if status == 400 and not (err.get("param") or err.get("code")):
        return "a 400 that names no field"
    return None


def _reference(loop, url: str, session) -> str:
    status, text = loop.run_until_complete(
        _post(
            session,
            f"{url}/v1/completions",
            json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5}).encode(),
        )
    )
    assert status == 200, text
    return json.loads(text)["choices"][0]["text"]


def test_hostile_http_bodies_get_clear_answers_and_the_app_keeps_serving(app):
    loop, url, session, _ = app
    seen: list[int] = []
    bad: list[tuple[str, int, str, str]] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(BODIES.map(lambda c: (c[0], _dumps(c[1]))), RAW.map(_raw_case)))
    def one(case):
        path, data = case
        status, text = loop.run_until_complete(_post(session, f"{url}{path}", data))
        seen.append(status)
        if why := _check(status, text):
            bad.append((path, status, why, text[:200]))

    one()
    print(f"http: {len(seen)} cases, statuses {sorted(set(seen))}")
    assert len(seen) >= EXAMPLES * 2 // 3
    assert not bad, f"unclear answers: {bad[:5]}"
    assert _reference(loop, url, session) == "Hello"


def _dumps(body) -> bytes:
    # NOTE: allow_nan: Python clients can send NaN/Infinity literals, which json.loads accepts
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def _raw_case(data: bytes) -> tuple[str, bytes]:
    return "/v1/completions", data
