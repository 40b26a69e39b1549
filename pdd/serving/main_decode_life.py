"""What MainDecode's request life is made of (``pdd.serving.main_decode``): the items on a
request's mailbox besides the engine loop's (``Extended``, ``EmitFrom``, ``Failed``) and the
request's own record (``DecodeLife``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdd.core.stage_events import DecodeJob
from pdd.engine.sampling import Logprob

# --- MainDecode's own mailbox items -----------------------------------------------------------


@dataclass(frozen=True)
class Extended:
    """``token_ids`` were made the outputs from ``start`` on the engine thread (``rolled_back``:
    what was decoded past them was dropped); apply it, then resolve ``applied``."""

    start: int
    token_ids: tuple[int, ...]
    rolled_back: bool
    applied: asyncio.Future

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"start: must be >= 0, got {self.start}")


@dataclass(frozen=True)
class EmitFrom:
    """MainDecode speaks from output ``position`` on (what it produced there already, at once)."""

    position: int

    def __post_init__(self) -> None:
        if self.position < 0:
            raise ValueError(f"position: must be >= 0, got {self.position}")


@dataclass(frozen=True)
class Failed:
    """Receiving or importing the request's KV failed: the request fails with ``error``."""

    error: Exception

    def __post_init__(self) -> None:
        if not isinstance(self.error, Exception):
            raise ValueError(f"error: must be an Exception, got {type(self.error).__name__}")


@dataclass
class DecodeLife:
    job: DecodeJob
    queue: asyncio.Queue
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)
    # Highest output position the engine has produced (or reached by an extension).
    produced: int = -1
    finished: bool = False
    finish_reason: str | None = None
    outputs: dict[int, int] = field(default_factory=dict)
    # Of the outputs this engine sampled (not those another stage's tokens extended), when asked for.
    logprobs: dict[int, Logprob] = field(default_factory=dict)
    # The output position MainDecode speaks from; None until it is known.
    emit_from: int | None = None
    md_tokens: int = 0
    wan_bytes: int = 0
    extend_s: float = 0.0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    # Prompt tokens found (and locked) in the DRC at admission; None until admitted. A push
    # starts here (``main_decode_guard``).
    cached_tokens: int | None = None
    # Outputs fixed by the handoff so far (or resumed from): never rewritten by a later batch.
    handed: int = 0
    # Where the final handoff batch ended (MainDecode speaks from there); None before it.
    handoff_end: int | None = None
    # NOTE: one handoff batch of a request at a time, whichever stream it came on: an extension
    # waits for the engine, and another batch in between would act on half-applied outputs.
    handoff_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def agrees(self, start: int, token_ids: Sequence[int]) -> bool:
        """Whether the outputs from ``start`` are ``token_ids`` already."""
        return all(self.outputs.get(start + i) == t for i, t in enumerate(token_ids))
