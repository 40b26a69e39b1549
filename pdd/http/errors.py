"""The one mapping from errors to HTTP status codes and OpenAI's error JSON.

Library code raises ``pdd.core.errors`` exceptions; ``pdd.server.errors`` maps them to a
gRPC status, and this module maps a status to HTTP. Errors only HTTP has (a bad key, a
body that is not JSON, an unknown model or route) are ``ApiError``s, already
in OpenAI's terms. Every error body is
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdd.core import errors
from pdd.server.errors import is_domain_error, status_for

INVALID = "invalid_request_error"
# Seconds a client refused for load (429: a stage or the gateway is full) is asked to wait.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An HTTP-only error, with its status and OpenAI's type/param/code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )


# gRPC status → HTTP: a stage service's status (seen through the gateway's calls to it), and
# our own exceptions, mapped to a status once in ``pdd.server.errors``.
# NOTE: FailedPrecondition is 500 here, not 400: in PDD it means the pipeline broke mid-request
# (a gap in the token stream, a failed fast link), which the client cannot fix by changing the request.
_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID),
    grpc.StatusCode.OUT_OF_RANGE: (400, INVALID),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (500, "server_error"),
}


def error_body(
    message: str, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def http_error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body a client should see for ``exc``."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, grpc.aio.AioRpcError):
        status, kind = _GRPC.get(exc.code(), (500, "server_error"))
        return status, error_body(f"{exc.code().name.lower()}: {exc.details()}", kind)
    if isinstance(exc, errors.PeerError):  # a stage's status, seen through a peer client
        status, kind = _GRPC.get(grpc.StatusCode[exc.code], (500, "server_error"))
        return status, error_body(f"{exc.code.lower()}: {exc.details}", kind)
    code, message = status_for(exc)
    status, kind = _GRPC.get(code, (500, "server_error"))
    param = exc.field if isinstance(exc, errors.InvalidArgumentError) else None
    return status, error_body(message, kind, param)


def error_headers(status: int) -> dict[str, str]:
    """The headers an error response carries: ``Retry-After`` on a refusal for load (429)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else {}


def is_expected(exc: BaseException) -> bool:
    """Whether ``exc`` is an expected error (logged without a traceback)."""
    return isinstance(exc, (ApiError, grpc.aio.AioRpcError, errors.PeerError)) or is_domain_error(
        exc
    )
