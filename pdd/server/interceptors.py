"""Per-call context for every gRPC method of every service.

The interceptor wraps each method handler so that, for the life of one call:
- structlog contextvars hold ``request_id`` (from the ``x-request-id``
  metadata, else generated), ``service`` and ``rpc``, so every log line of the
  call — and of the calls it makes onwards, which forward the id — can be
  followed across services;
- a domain error raised by the servicer becomes the status code and message
  chosen by ``pdd.server.errors`` (errors in one place).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from pdd.server.errors import is_domain_error, status_for

REQUEST_ID_KEY = "x-request-id"
log = structlog.get_logger(__name__)


def request_id_from(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return value
    return None


async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_for(exc)
    if is_domain_error(exc):
        log.info("rpc_error", code=code.name, error=message)
    else:
        log.exception("rpc_internal_error", code=code.name)
    await context.abort(code, message)


def _bind(context: grpc.aio.ServicerContext, method: str) -> None:
    service, _, rpc = method.lstrip("/").rpartition("/")
    structlog.contextvars.bind_contextvars(
        request_id=request_id_from(context) or uuid.uuid4().hex, grpc_service=service, rpc=rpc
    )


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]], method: str
) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        _bind(context, method)
        try:
            return await behavior(request_or_iterator, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 — mapped to a status, never swallowed
            await _fail(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        _bind(context, method)
        try:
            async for item in behavior(request_or_iterator, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _fail(context, exc)

    return wrapped


class ContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds log context and maps domain errors for every RPC."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), **kw
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method), **kw
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), **kw
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method), **kw
        )


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata that forwards the current request_id on a call to another service."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()
