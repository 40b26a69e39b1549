"""Structured logging, configured once per process.

Every log line carries the contextvars bound by the gRPC interceptor
(request_id, service, rpc) first, then a snake_case event name and key=value
fields. JSON in production (``PDD_LOG_FORMAT=json``, the default for
services), a console renderer for humans.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(service: str, *, level: str = "INFO", json: bool = True) -> None:
    """Configure structlog and stdlib logging for ``service``; idempotent."""
    global _configured
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level: unknown level {level!r}")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    _configured = True


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A logger; log lines pick up the current request's contextvars."""
    return structlog.get_logger(name)
