"""Domain errors of PDD.

Library code raises these; ``pdd.server.errors`` is the one place that maps
them to gRPC status codes (and the HTTP layer to HTTP codes). Each error says
what was wrong in words a client can act on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class PddError(Exception):
    """Base of every domain error."""


class InvalidArgumentError(PddError, ValueError):
    """A request field is malformed; ``field`` names it (e.g. ``sampling.top_p``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class NotFoundError(PddError, KeyError):
    """A referenced entity (request, instance, transfer) is unknown."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class ResourceExhaustedError(PddError):
    """A pool, queue or budget is full; retrying later may succeed."""


class UnavailableError(PddError):
    """A needed peer or role is not reachable or not registered."""


class FailedPreconditionError(PddError):
    """The request is valid but the system is not in a state to run it."""


class DeadlineExceededError(PddError):
    """An operation outlived its deadline."""


class PeerError(PddError):
    """A call to another service failed with ``code`` (a gRPC status name, e.g. "UNAVAILABLE").

    The typed peer clients (``pdd.wire``) raise it so that the roles never see the transport's
    own exceptions; passed on to a caller, it keeps the peer's status and message.
    """

    def __init__(self, code: str, details: str, peer: str = "") -> None:
        super().__init__(f"{peer}: {details}" if peer else details)
        self.code = code
        self.details = details
        self.peer = peer

    @property
    def cancelled(self) -> bool:
        return self.code == "CANCELLED"

    @property
    def lost(self) -> bool:
        """The peer, or its state for the request, is gone (died, unreachable, restarted or
        the request moved away), as opposed to the peer refusing what was asked."""
        return self.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "NOT_FOUND")


@contextmanager
def field_prefix(prefix: str) -> Iterator[None]:
    """Re-raise an ``InvalidArgumentError`` from inside with its field under ``prefix``:
    ``top_p`` → ``sampling.top_p``, so a rule validated once still names the caller's field."""
    try:
        yield
    except InvalidArgumentError as exc:
        if not prefix:
            raise
        raise InvalidArgumentError(f"{prefix}.{exc.field}", exc.description) from None
