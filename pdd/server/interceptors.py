"""Per-call context for every gRPC method of every service.

The interceptor wraps each method handler so that, for the life of one call:
- structlog contextvars hold ``request_id`` (from the ``x-request-id``
  metadata, else generated), ``service`` and ``rpc``, so every log line of the
  call — and of the calls it makes onwards, which forward the id — can be
  followed across services;
- a domain error raised by the servicer becomes the status code and message
  chosen by ``pdd.server.errors`` (errors in one place), as does a request
  whose bytes do not parse (``handlers.decode_checked``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import structlog

from pdd.server.errors import is_domain_error, status_for
from pdd.server.handlers import decode_checked, wrap_handler

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


@asynccontextmanager
async def _call_context(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    _bind(context, method)
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 — mapped to a status, never swallowed
        await _fail(context, exc)


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
        # NOTE: decode_checked inside the call context, so a request that does not parse is
        # mapped like any domain error (INVALID_ARGUMENT naming "request"), not grpc's UNKNOWN.
        return wrap_handler(decode_checked(handler), lambda context: _call_context(context, method))


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata that forwards the current request_id on a call to another service."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()
