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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import structlog

from pdd.server.handlers import wrap_handler
from pdd.server.interceptors import REQUEST_ID_KEY
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)


def _code_of(exc: BaseException | None, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    # NOTE: an exception that escaped every mapping is what grpc reports as UNKNOWN.
    return "OK" if exc is None else "UNKNOWN"


@asynccontextmanager
async def _measured(
    context: grpc.aio.ServicerContext, method: str, request_scoped: bool
) -> AsyncIterator[None]:
    service, _, rpc = method.lstrip("/").rpartition("/")
    t0, exc = time.perf_counter(), None
    try:
        yield
    except BaseException as e:
        exc = e
        raise
    finally:
        code = _code_of(exc, context)
        elapsed = time.perf_counter() - t0
        metrics.GRPC_HANDLED.labels(service, rpc, code).inc()
        metrics.GRPC_SECONDS.labels(service, rpc).observe(elapsed)
        emit = log.info if request_scoped else log.debug
        emit("rpc_finished", code=code, ms=round(elapsed * 1000, 2))


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
        return wrap_handler(handler, lambda context: _measured(context, details.method, scoped))
