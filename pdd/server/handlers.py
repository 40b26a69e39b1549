"""Wrapping a gRPC method handler, whatever its arity, in one per-call "around" hook.

An interceptor (``pdd.server.interceptors``, ``pdd.server.telemetry_interceptor``) gives
``wrap_handler`` a function of the call's context that returns an async context manager; each
call of the method then runs inside it — the whole stream for a streaming response, so the
hook sees how the call really ended (an exception, a cancellation, or none).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

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
