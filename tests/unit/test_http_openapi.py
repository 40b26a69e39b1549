"""``GET /openapi.json``: a valid OpenAPI 3.1 document of the API, served without a key, whose
request schemas list exactly the body fields the converter reads (read from its source, so a
field added to one and not the other fails here)."""

from __future__ import annotations

import ast
import inspect

import aiohttp
import pytest

from pdd.http import openai_api, openai_convert, openapi
from pdd.http.config import HttpConfig
from tests.unit import test_http_api
from tests.unit.test_http_api import ScriptedGateway

serve = test_http_api.serve  # the fixture: the HTTP face on a loopback port

_ACCESSORS = {"_int", "_number", "_bool", "_str"}


def _fields_read(fn) -> set[str]:
    """The body fields ``fn`` reads: ``body.get("x")``, ``body["x"]``, ``_int(body, "x", ...)``."""
    out = set()
    for node in ast.walk(ast.parse(inspect.getsource(fn).strip())):
        match node:
            case ast.Call(
                func=ast.Attribute(value=ast.Name(id="body"), attr="get"),
                args=[ast.Constant(value=str() as name), *_],
            ):
                out.add(name)
            case ast.Call(
                func=ast.Name(id=f),
                args=[ast.Name(id="body"), ast.Constant(value=str() as name), *_],
            ) if f in _ACCESSORS:
                out.add(name)
            case ast.Subscript(value=ast.Name(id="body"), slice=ast.Constant(value=str() as name)):
                out.add(name)
    return out


def _accepted(route) -> set[str]:
    """Every field a route's converter reads (``_refuse_unsupported`` reads only to refuse)."""
    shared = (
        openai_convert._common,
        openai_convert._generate_request,
        openai_convert._stop_strings,
        openai_convert.request_timeout,
        openai_api.OpenAIServer._body,
    )
    extra = {
        "completions": (openai_convert.completion_request, openai_convert._prompts),
        "chat": (openai_convert.chat_request,),
    }[route]
    return set().union(*(_fields_read(f) for f in (*shared, *extra)))


def test_the_scan_finds_what_it_should():
    # NOTE: guards the AST patterns above: a scan that found nothing would pass vacuously
    assert {"temperature", "seed", "stop", "logit_bias", "response_format"} <= _accepted("chat")
    assert {"prompt", "echo", "timeout", "model"} <= _accepted("completions")


@pytest.mark.parametrize(
    "route, schema",
    [("completions", "CompletionRequest"), ("chat", "ChatCompletionRequest")],
)
def test_the_schema_lists_exactly_the_fields_the_converter_reads(route, schema):
    doc = openapi.document("m")
    listed = set(doc["components"]["schemas"][schema]["properties"])
    read = _accepted(route)
    assert read - listed == set(), "read by the converter, missing from the schema"
    assert listed - read == set(), "in the schema, never read by the converter"


def test_the_document_is_valid_openapi_3_1():
    validator = pytest.importorskip("openapi_spec_validator")
    doc = openapi.document("m")
    validator.validate(doc)  # raises on an invalid document
    assert doc["openapi"].startswith("3.1")


async def test_it_is_served_without_a_key(serve):
    url = await serve(ScriptedGateway(), api_keys=("sk-a",), served_model_name="pdd-model")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/openapi.json") as r:
            assert r.status == 200 and r.content_type == "application/json"
            doc = await r.json()
        async with s.get(f"{url}/v1/models") as r:
            assert r.status == 401  # the API itself still needs the key
    assert doc == openapi.document("pdd-model")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/openapi.json"} <= set(
        doc["paths"]
    )


def test_every_route_the_app_serves_is_in_the_document():
    doc = openapi.document("m")
    server = openai_api.OpenAIServer(ScriptedGateway(), test_http_api.INFO, None, HttpConfig())
    routes = {
        (r.resource.canonical, r.method.lower())
        for r in server.app.router.routes()
        if r.method != "HEAD"
    }
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert routes == documented
