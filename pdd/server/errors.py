"""The one mapping from domain errors to gRPC status codes.

Servicers never pick status codes themselves: they raise ``pdd.core.errors``
exceptions, and the interceptor in ``pdd.server.interceptors`` turns them
into a status with a human message via :func:`status_for`.
"""

from __future__ import annotations

import asyncio

import grpc

from pdd.core import errors
from pdd.engine.block_pool import PoolExhaustedError
from pdd.engine.errors import KvCapacityError

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (asyncio.TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # NOTE: plain ValueError from validated configs/dataclasses is a bad argument too.
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for ``exc``."""
    if isinstance(exc, grpc.aio.AioRpcError):
        # NOTE: a downstream service already chose the status; pass it on unchanged.
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, errors.PeerError):
        # NOTE: the same, seen through a typed peer client (pdd.wire).
        return grpc.StatusCode[exc.code], exc.details or exc.code
    if isinstance(exc, KvCapacityError):
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"max_tokens: {exc} (lower max_tokens or the prompt)",
        )
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc) or kind.__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def is_domain_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an expected, client-facing error (logged without a traceback)."""
    return status_for(exc)[0] not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
