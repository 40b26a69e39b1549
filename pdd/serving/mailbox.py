"""What the engine loop puts on a request's queue, besides the engine's own ``StepOutput``.

A request's queue (``EngineLoop.open(request_id)``) receives, in order:

- ``pdd.engine.engine.StepOutput`` for each token the engine sampled for the request;
- ``StepFailed(error)`` when an engine step raised: the request was aborted, nothing follows.

Roles match these with ``match``/``case``; a role's own items (e.g. MainDecode's extensions)
live beside the role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFailed:
    """An engine step failed; the request was aborted."""

    error: Exception

    def __post_init__(self) -> None:
        if not isinstance(self.error, Exception):
            raise ValueError(f"error: must be an Exception, got {type(self.error).__name__}")
