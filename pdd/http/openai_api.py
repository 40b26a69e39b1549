"""The OpenAI-compatible HTTP API, served by the gateway beside its gRPC server.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each
streamed as server-sent events ending in ``data: [DONE]``, or whole),
``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (kvstore lists
a prefill and a main_decode), ``GET /metrics`` (Prometheus), ``GET /openapi.json``
(the API's OpenAPI 3.1 document, ``openapi``).

Life of a request: the middleware picks the request_id (``X-Request-Id`` or
a new one) and binds it for logs and for every gRPC hop → API key check for
``/v1/*`` when keys are configured (a ``key:tenant`` key puts the request in its
tenant's cache salt) → the body (at most ``max_body_bytes``, else 413) is parsed
and converted (``openai_convert``) → the same ``Gateway.generate`` as gRPC runs
it, within the request's ``timeout`` → text deltas (``text_stream``) → JSON.
A streamed response starts only with its first token, so a request that fails
before that still gets its proper status code; a failure after it is sent as
an ``{"error": ...}`` event before ``[DONE]``. Every error, wherever raised,
is mapped once, by ``pdd.http.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from pdd.core.errors import InvalidArgumentError
from pdd.core.model_info import ModelInfo
from pdd.core.request import new_request_id
from pdd.core.sampling_params import Logprob
from pdd.http import openai_convert as conv
from pdd.http import openai_responses as responses
from pdd.http import openapi
from pdd.http.config import HttpConfig
from pdd.http.errors import ApiError, error_body, error_headers, http_error_for, is_expected
from pdd.http.text_stream import Delta, End, choice_events
from pdd.serving.gateway import Gateway
from pdd.telemetry import metrics
from pdd.wire.gateway import valid_id

log = structlog.get_logger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)
# The tenant of the request's API key (None: tenants are not configured)
TENANT = web.RequestKey("tenant", object)
_REQUIRED_ROLES = ("prefill", "main_decode")
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


class OpenAIServer:
    def __init__(
        self,
        gateway: Gateway,
        info: ModelInfo,
        decode: Callable[[Sequence[int]], str] | None,
        config: HttpConfig,
    ) -> None:
        self.gateway, self.info, self.decode, self.config = gateway, info, decode, config
        self.model = config.served_model_name or info.name
        self.created = int(time.time())
        self._openapi = openapi.document(self.model)
        self.app = web.Application(
            middlewares=[self._middleware], client_max_size=config.max_body_bytes
        )
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", self.metrics),
                web.get("/openapi.json", self.openapi),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model_card),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> str:
        """Listen (in the running event loop); returns ``host:port``."""
        # NOTE: handler_cancellation: a client that disconnects cancels its request everywhere.
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.grace_s,
        )
        await self._runner.setup()
        ssl_context = self.config.tls.server_ssl_context()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.port, ssl_context=ssl_context
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        address = f"{self.config.host}:{self.port}"
        tls_on = ssl_context is not None
        log.info(
            "http_started",
            address=address,
            model=self.model,
            auth=bool(self.config.api_keys),
            tls=tls_on,
            mutual_tls=tls_on and self.config.tls.require_client_cert,
        )
        return address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- every request --------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        header = request.headers.get("X-Request-Id", "")
        rid = header if header and valid_id(header) else new_request_id()
        request[REQUEST_ID] = rid
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        t0 = time.perf_counter()

        def done(status: int) -> None:
            metrics.HTTP_REQUESTS.labels(route, str(status)).inc()
            (log.info if route.startswith("/v1/") else log.debug)(
                "http_request",
                method=request.method,
                path=request.path,
                status=status,
                ms=round((time.perf_counter() - t0) * 1000, 2),
            )

        with structlog.contextvars.bound_contextvars(request_id=rid, http_route=route):
            try:
                self._authorize(request)
                resp = await handler(request)
            except (ConnectionResetError, asyncio.CancelledError):
                done(499)  # NOTE: nginx's "client closed request"
                raise
            except (
                web.HTTPException
            ) as exc:  # aiohttp's own: unknown route, wrong method, body too large
                resp = _json(
                    error_body(exc.text or exc.reason, code=_HTTP_CODES.get(exc.status)), exc.status
                )
            except Exception as exc:  # noqa: BLE001 — mapped to a status, never swallowed
                resp = self._error(exc)
            if not resp.prepared:
                resp.headers["x-request-id"] = rid
            done(resp.status)
            return resp

    def _error(self, exc: BaseException) -> web.Response:
        status, body = http_error_for(exc)
        if is_expected(exc):
            log.info("http_error", status=status, error=body["error"]["message"])
        else:
            log.exception("http_internal_error", status=status)
        resp = _json(body, status)
        resp.headers.update(error_headers(status))
        return resp

    def _authorize(self, request: web.Request) -> None:
        request[TENANT] = None
        if not self.config.api_keys or not request.path.startswith("/v1/"):
            return
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(
                401,
                "No API key provided: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        # NOTE: every key compared, so the time taken does not say which one matched
        matched = [k for k in self.config.keys if hmac.compare_digest(key.encode(), k.encode())]
        if not matched:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        if tenants := self.config.tenants:
            request[TENANT] = tenants[matched[0]]

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()  # NOTE: raises 413 past client_max_size
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ApiError(
                400, f"The request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        except RecursionError:  # NOTE: found by fuzzing: [[[[...]]]] was a 500
            raise ApiError(
                400, "The request body is nested too deeply.", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise InvalidArgumentError("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgumentError(
                "model", "is required: the id of a model from GET /v1/models"
            )
        if model != self.model:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model}'.",
                param="model",
                code="model_not_found",
            )
        return body

    # ---- routes -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        try:
            instances = await asyncio.wait_for(self.gateway.instances(), 5.0)
        except Exception as exc:  # noqa: BLE001 — not ready, and the reason is the answer
            return _json(
                {"status": "not_ready", "reason": f"kvstore: {type(exc).__name__}: {exc}"}, 503
            )
        roles = Counter(i.ref.role.value for i in instances)
        missing = [r for r in _REQUIRED_ROLES if not roles[r]]
        return _json(
            {
                "status": "not_ready" if missing else "ready",
                "instances": dict(roles),
                "missing": missing,
            },
            503 if missing else 200,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(REGISTRY))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def openapi(self, request: web.Request) -> web.Response:
        """The API's OpenAPI document (no key needed: it says what the API takes, not more)."""
        return _json(self._openapi)

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "pdd",
            "max_model_len": self.info.max_context_tokens,
        }

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            raise ApiError(
                404,
                f"The model '{request.match_info['model']}' does not exist.",
                code="model_not_found",
            )
        return _json(self._card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, conv.completion_request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, conv.chat_request)

    # ---- generation -----------------------------------------------------------------
    async def _generate(self, request: web.Request, convert) -> web.StreamResponse:
        body = await self._body(request)
        timeout_s = conv.request_timeout(body, request.headers.get(conv.TIMEOUT_HEADER, ""))
        api = convert(body, self.info, request[REQUEST_ID])
        if (tenant := request.get(TENANT)) is not None:
            api = api.for_tenant(tenant)
        api = api.routed(
            *conv.route_overrides(
                request.headers.get(conv.PIPELINE_HEADER, ""),
                request.headers.get(conv.HANDOFF_HEADER, ""),
            )
        )
        events = choice_events(
            self.gateway, api.choice_jobs(), self.decode, api.stop, timeout_s=timeout_s
        )
        async with contextlib.aclosing(events):
            if api.stream:
                return await self._stream(request, api, events)
            return await self._whole(api, events)

    def _token_text(self, token: int) -> str:
        # NOTE: a model without a tokenizer has no token strings; vLLM's spelling for that case
        return self.decode([token]) if self.decode is not None else f"token_id:{token}"

    def _prompt_text(self, api: conv.ApiRequest, choice: int) -> str:
        """The prompt as echoed: as given, or its token ids detokenized."""
        text = api.prompt_texts[choice // api.n] if api.prompt_texts else None
        if text is not None:
            return text
        ids = api.prompt_of(choice).prompt_token_ids
        return self.decode(ids) if self.decode is not None else "".join(map(self._token_text, ids))

    @staticmethod
    def _scores(prompt: tuple[Logprob, ...] | None) -> tuple[Logprob, ...]:
        if prompt is None:  # NOTE: the gateway fails a request whose output 0 lacks them
            raise RuntimeError("the prompt's logprobs were asked for but never came")
        return prompt

    @staticmethod
    def _usage(api: conv.ApiRequest, ends: dict[int, End]) -> tuple[int, int, int | None]:
        """(prompt tokens, once per prompt; completion tokens over every choice; the prompt tokens
        served from cache, as the prompt tokens, None unless every prompt's count is known)."""
        firsts = [ends[p * api.n] for p in range(len(api.jobs))]
        prompt = sum(e.prompt_tokens for e in firsts)
        completion = sum(e.completion_tokens for e in ends.values()) if api.generate else 0
        known = all(e.cached_tokens is not None for e in firsts)
        cached = sum(e.cached_tokens or 0 for e in firsts) if known else None
        return prompt, completion, cached

    def _choice(
        self,
        api: conv.ApiRequest,
        i: int,
        text: str,
        ids: list[int],
        logprobs: list[Logprob],
        prompt: tuple[Logprob, ...] | None,
        end: End,
    ) -> responses.Choice:
        prompt_ids = api.prompt_of(i).prompt_token_ids
        items: list[tuple[int, Logprob | None]] = list(zip(ids, logprobs))
        if api.echo:
            text = self._prompt_text(api, i) + text
            if api.logprobs:
                items = responses.echo_items(api, prompt_ids, self._scores(prompt)) + items
        return responses.Choice(
            text,
            responses.finish_reason(end.finish_reason) if api.generate else "length",
            ids,
            responses.logprobs_body(api, items, self._token_text) if api.logprobs else None,
            None
            if api.prompt_logprobs is None
            else responses.prompt_logprobs_body(
                prompt_ids, self._scores(prompt), api.prompt_logprobs, self._token_text
            ),
        )

    async def _whole(
        self, api: conv.ApiRequest, events: AsyncIterator[tuple[int, Delta | End]]
    ) -> web.Response:
        k = api.num_choices
        texts: list[list[str]] = [[] for _ in range(k)]
        ids: list[list[int]] = [[] for _ in range(k)]
        logprobs: list[list[Logprob]] = [[] for _ in range(k)]
        prompts: list[tuple[Logprob, ...] | None] = [None] * k
        ends: dict[int, End] = {}
        async for i, ev in events:
            if isinstance(ev, Delta):
                if ev.prompt_logprobs is not None:
                    prompts[i] = ev.prompt_logprobs
                if api.generate:  # NOTE: echo without generation drops the one token generated
                    texts[i].append(ev.text)
                    ids[i].extend(ev.token_ids)
                    logprobs[i].extend(ev.logprobs)
            else:
                ends[i] = ev
        assert len(ends) == k, "every request life ends with a final event"
        choices = [
            self._choice(api, i, "".join(texts[i]), ids[i], logprobs[i], prompts[i], ends[i])
            for i in range(k)
        ]
        return _json(responses.response_body(api, choices, *self._usage(api, ends)))

    def _echo_chunk(
        self, api: conv.ApiRequest, i: int, prompt: tuple[Logprob, ...] | None, offsets: list[int]
    ) -> dict[str, Any]:
        """A streamed choice's first chunk under echo: the prompt (and its logprobs)."""
        logprobs = None
        if api.logprobs:
            items = responses.echo_items(
                api, api.prompt_of(i).prompt_token_ids, self._scores(prompt)
            )
            logprobs = responses.logprobs_body(api, items, self._token_text, offsets[i])
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
        return responses.chunk_body(
            api, self._prompt_text(api, i), None, None, index=i, logprobs=logprobs
        )

    async def _stream(
        self,
        request: web.Request,
        api: conv.ApiRequest,
        events: AsyncIterator[tuple[int, Delta | End]],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": request[REQUEST_ID]})

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else _dumps(obj)) + b"\n\n")

        ends: dict[int, End] = {}
        k = api.num_choices
        offsets = [0] * k  # completions' text_offset continues over a choice's chunks
        echoed = [not api.echo] * k
        try:
            async for i, ev in events:
                if not resp.prepared:
                    await resp.prepare(request)
                    if api.kind == conv.CHAT:
                        for c in range(k):
                            await send(responses.chunk_body(api, role=True, index=c))
                if isinstance(ev, Delta):
                    if not echoed[i]:
                        echoed[i] = True
                        await send(self._echo_chunk(api, i, ev.prompt_logprobs, offsets))
                    if not api.generate:
                        continue
                    logprobs = None
                    if api.logprobs and ev.token_ids:
                        logprobs = responses.logprobs_body(
                            api, list(zip(ev.token_ids, ev.logprobs)), self._token_text, offsets[i]
                        )
                        if api.kind == conv.COMPLETION:
                            offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    if ev.text or api.return_token_ids or logprobs:
                        await send(
                            responses.chunk_body(
                                api, ev.text, None, ev.token_ids, index=i, logprobs=logprobs
                            )
                        )
                    continue
                ends[i] = ev
                finish = responses.finish_reason(ev.finish_reason) if api.generate else "length"
                await send(responses.chunk_body(api, "", finish, (), index=i))
                if api.include_usage and len(ends) == k:
                    await send(responses.usage_chunk(api, *self._usage(api, ends)))
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("http_client_gone")
            raise
        except Exception as exc:  # noqa: BLE001
            if not resp.prepared:
                raise  # NOTE: nothing sent yet: the middleware answers with the proper status code
            status, body = http_error_for(exc)
            (log.info if is_expected(exc) else log.exception)("http_stream_error", status=status)
            await send(body)
        await send(b"[DONE]")
        await resp.write_eof()
        return resp


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
