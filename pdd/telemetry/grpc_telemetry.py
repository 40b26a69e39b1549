"""Per-call telemetry of every gRPC server: counts, durations, an access log line.

``TelemetryInterceptor`` is the outermost interceptor (before
``ContextInterceptor``, which binds request_id and maps domain errors to
status codes), so it sees each call's final status code and its whole
duration — a stream's too. Calls that belong to a user request (they carry
``x-request-id`` metadata) get an ``rpc_finished`` line at INFO, which is how
every hop of one request shows up in every service's log; background calls
(heartbeats, cache events, health checks) log at DEBUG only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from pdd.server.interceptors import REQUEST_ID_KEY
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)


class _Call:
    """One call's bookkeeping: labels, start time, final code."""

    def __init__(self, method: str, request_scoped: bool) -> None:
        self.service, _, self.method = method.lstrip("/").rpartition("/")
        self.request_scoped = request_scoped
        self.t0 = time.perf_counter()

    def code_of(self, exc: BaseException | None, context: grpc.aio.ServicerContext) -> str:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED"
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code.name
        # NOTE: an exception that escaped every mapping is what grpc reports as UNKNOWN.
        return "OK" if exc is None else "UNKNOWN"

    def done(self, code: str) -> None:
        elapsed = time.perf_counter() - self.t0
        metrics.GRPC_HANDLED.labels(self.service, self.method, code).inc()
        metrics.GRPC_SECONDS.labels(self.service, self.method).observe(elapsed)
        emit = log.info if self.request_scoped else log.debug
        emit("rpc_finished", code=code, ms=round(elapsed * 1000, 2))


def _unary(
    behavior: Callable[..., Awaitable[Any]], call: Callable[[], _Call]
) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        c, exc = call(), None
        try:
            return await behavior(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            c.done(c.code_of(exc, context))

    return wrapped


def _stream(behavior: Callable[..., Any], call: Callable[[], _Call]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        c, exc = call(), None
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as e:
            exc = e
            raise
        finally:
            c.done(c.code_of(exc, context))

    return wrapped


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        scoped = any(k == REQUEST_ID_KEY for k, _ in details.invocation_metadata or ())

        def call() -> _Call:
            return _Call(details.method, scoped)

        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, call), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, call), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_stream(handler.unary_stream, call), **kw)
        return grpc.stream_stream_rpc_method_handler(_stream(handler.stream_stream, call), **kw)
