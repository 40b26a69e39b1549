"""Wrapping a gRPC method handler, whatever its arity, in one per-call "around" hook.

An interceptor (``pdd.server.interceptors``, ``pdd.server.telemetry_interceptor``) gives
``wrap_handler`` a function of the call's context that returns an async context manager; each
call of the method then runs inside it — the whole stream for a streaming response, so the
hook sees how the call really ended (an exception, a cancellation, or none).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdd.core.errors import InvalidArgumentError

# The hook: entered before the servicer runs, exited with whatever ended the call.
Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """``handler`` with each call run inside ``around(context)``."""
    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, around), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, around), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_stream(handler.unary_stream, around), **kw)
    return grpc.stream_stream_rpc_method_handler(_stream(handler.stream_stream, around), **kw)


def _unary(
    behavior: Callable[..., Awaitable[Any]], around: Around
) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(context):
            return await behavior(request_or_iterator, context)

    return wrapped


def _stream(behavior: Callable[..., Any], around: Around) -> Callable[..., Any]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(context):
            async for item in behavior(request_or_iterator, context):
                yield item

    return wrapped


class _Undecodable:
    """What a request that is not a valid message deserializes to (grpc's deserializer must not
    raise: its error would reach the client as UNKNOWN, outside any interceptor)."""

    def __init__(self, deserializer: Callable[[bytes], Any], error: Exception) -> None:
        kind = getattr(deserializer, "__self__", None)
        self.name = getattr(getattr(kind, "DESCRIPTOR", None), "full_name", "the request message")
        self.error = error

    def raise_(self) -> None:
        raise InvalidArgumentError("request", f"is not a valid {self.name}: {self.error}")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, RuntimeError) as exc:  # NOTE: RuntimeError: recursion
            return _Undecodable(deserializer, exc)

    return deserialize


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            request.raise_()
        yield request


def decode_checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` whose requests that do not parse raise ``InvalidArgumentError`` ("request:
    is not a valid <message>") inside the servicer's call, where the interceptor that wraps it
    maps it to INVALID_ARGUMENT, instead of grpc answering UNKNOWN."""
    kw = dict(
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )

    def unary_request(request: Any) -> Any:
        if isinstance(request, _Undecodable):
            request.raise_()
        return request

    if handler.unary_unary:
        behavior = handler.unary_unary

        async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(unary_request(request), context)

        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if handler.unary_stream:
        stream_behavior = handler.unary_stream

        async def us(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async for item in stream_behavior(unary_request(request), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(us, **kw)
    if handler.stream_unary:
        su_behavior = handler.stream_unary

        async def su(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await su_behavior(_checked_stream(requests), context)

        return grpc.stream_unary_rpc_method_handler(su, **kw)
    ss_behavior = handler.stream_stream

    async def ss(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for item in ss_behavior(_checked_stream(requests), context):
            yield item

    return grpc.stream_stream_rpc_method_handler(ss, **kw)


class _Overriding:
    """The server a generated ``add_*Servicer_to_server`` registers on: its method table, with
    some handlers replaced, goes to the real server."""

    def __init__(self, server: grpc.aio.Server, overrides: Mapping[str, grpc.RpcMethodHandler]):
        self.server = server
        self.overrides = overrides
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # NOTE: rebuilt from the method table in add_registered_method_handlers

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        unknown = sorted(set(self.overrides) - set(handlers))
        if unknown:
            raise ValueError(f"overrides: {service} has no method {', '.join(unknown)}")
        merged = {**handlers, **self.overrides}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, merged),)
        )
        self.server.add_registered_method_handlers(service, merged)
        self.registered = True


def register_overriding(
    add_servicer: Callable[[Any, Any], None],
    servicer: Any,
    server: grpc.aio.Server,
    overrides: Mapping[str, grpc.RpcMethodHandler],
) -> None:
    """``add_servicer(servicer, server)`` (a generated ``add_*Servicer_to_server``) with the
    handlers in ``overrides`` (method name → handler, e.g. another request deserializer) in
    place of the generated ones."""
    target = _Overriding(server, overrides)
    add_servicer(servicer, target)
    if not target.registered:  # NOTE: generated code of another shape: fail, never half-serve
        raise RuntimeError(f"{add_servicer.__name__} registered no method table")
