"""An engine role's bounded admission: at most N requests and T reserved KV tokens at once.

Each engine role (prefill, relay, MainDecode) asks ``Admission.admit`` at its admit step, before
any work: the request reserves the KV tokens it may ever hold (prefill: its prompt; the decoding
roles: prompt + max_tokens). Beyond either bound it is refused at once with
``ResourceExhaustedError`` (RESOURCE_EXHAUSTED on the wire), so the gateway can route it to
another instance or refuse its client, instead of the request queueing without limit inside the
engine. The request's ``Ticket`` is released when its life ends, however it ends.

The gateway's front door may also let a newcomer that finds it full *wait* a moment for a place
(``admit_within``): first come first served, each for at most ``wait_s``, then refused. It joins
the queue only if the places freed recently (the rate of releases) would reach it within
``wait_s`` — else it is refused at once: under a burst the queue holds what the stack will take
within ``wait_s`` and the excess is refused without waiting (and once a waiter has run out of
time, nobody queues for a while: the line is not moving), while a short peak of a load the
stack carries (Poisson arrivals at 70 % of capacity cluster) is queued for a moment instead.

# NOTE: admission never evicts: an admitted request keeps its place until it ends, whatever
# arrives after it. Refusals are counted per request (``pdd_admission_refused_total{role}``)
# but logged once per burst: the first refusal after an admission logs, the rest are silent.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from pdd.core.errors import ResourceExhaustedError
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)

# The clock of the waits' bookkeeping (a name of its own: tests set a fake one).
_now = time.monotonic

# After a waiter ran out of time, newcomers are refused at once for this many of its waits.
_DRY_SPELL = 4.0

# Requests one gateway generates at once unless told (--max-in-flight).
DEFAULT_MAX_IN_FLIGHT = 1024


@dataclass(frozen=True)
class AdmissionConfig:
    # Requests admitted at once; 0: the engine's max_num_seqs (a full running batch: one more
    # would only wait inside the engine, its deadline running).
    max_admitted: int = 0
    # KV tokens reserved at once (prompt + max_tokens each); 0: the engine's whole KV pool.
    max_admitted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_admitted < 0:
            raise ValueError(f"max_admitted: must be >= 0, got {self.max_admitted}")
        if self.max_admitted_tokens < 0:
            raise ValueError(f"max_admitted_tokens: must be >= 0, got {self.max_admitted_tokens}")


@dataclass(frozen=True)
class Limits:
    """The bounds in force: requests and KV tokens."""

    requests: int
    tokens: int

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests: must be >= 1, got {self.requests}")
        if self.tokens < 1:
            raise ValueError(f"tokens: must be >= 1, got {self.tokens}")


class _BatchConfig(Protocol):
    @property
    def max_num_seqs(self) -> int: ...


class KvPool(Protocol):
    """What admission reads of an engine (ours or vLLM's): its KV pool and batch size."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def config(self) -> _BatchConfig: ...


@dataclass(frozen=True)
class _Waiter:
    """A request waiting for a place: the future its ticket is handed in, and what it reserves."""

    ticket: asyncio.Future[Ticket]
    tokens: int


class Ticket:
    """One admitted request's reservation; ``release`` is idempotent."""

    def __init__(self, admission: Admission, tokens: int) -> None:
        self._admission = admission
        self.tokens = tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self.tokens)


class Admission:
    """The admission of one engine role. ``limits``: the bounds, read on first use (the engine's
    pool is known only once it is built); the role's event loop is its only caller."""

    def __init__(self, role: str, limits: Callable[[], Limits], *, fixed: bool = True) -> None:
        """``fixed``: read ``limits`` once (an engine's pool); else at every admission (the
        gateway's adaptive bound)."""
        self.role = role
        self._limits_of = limits
        self._limits: Limits | None = None
        self._fixed = fixed
        self.admitted = 0
        self.reserved_tokens = 0
        self._refusing = False
        self._waiting: deque[_Waiter] = deque()
        # When the last places were freed (monotonic s): the rate a waiter's turn comes at.
        self._released_at: deque[float] = deque(maxlen=32)
        # When a waiter last ran out of time (monotonic s).
        self._timed_out_at = -math.inf

    @classmethod
    def for_engine(
        cls, role: str, config: AdmissionConfig, engine: Callable[[], KvPool]
    ) -> Admission:
        """An admission whose unset bounds derive from ``engine()``: its batch size and KV pool
        (read on first use: the role is built before its engine)."""

        def limits() -> Limits:
            pool = engine()
            return Limits(
                config.max_admitted or pool.config.max_num_seqs,
                config.max_admitted_tokens or pool.num_blocks * pool.block_size,
            )

        return cls(role, limits)

    @property
    def limits(self) -> Limits:
        if self._limits is None or not self._fixed:
            self._limits = self._limits_of()
        return self._limits

    def admit(self, request_id: str, tokens: int) -> Ticket:
        """Reserve ``tokens`` for ``request_id``, or raise ``ResourceExhaustedError`` at once."""
        if tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {tokens}")
        if not self._fits(tokens):
            raise self._refuse(request_id, tokens)
        return self._take(tokens)

    async def admit_within(self, request_id: str, tokens: int, wait_s: float) -> Ticket:
        """``admit``, except that a request finding the role full may wait up to ``wait_s`` for a
        place, behind those already waiting (FIFO). Refused at once when as many are waiting as
        the bound admits, when a waiter ran out of time lately, or when the recent release rate
        would not reach it in ``wait_s``; refused after ``wait_s`` otherwise. A caller cancelled
        while waiting takes nothing."""
        if tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {tokens}")
        self._wake()  # NOTE: an adaptive bound may have grown since the last release
        # NOTE: nobody overtakes the queue: a newcomer is admitted directly only when it is empty
        if not self._waiting and self._fits(tokens):
            return self._take(tokens)
        # NOTE: a waiter that ran out of time lately says the line is not moving (overload, not
        # a peak): until ``wait_s`` × _DRY_SPELL after it, nobody joins — refused at once.
        if (
            wait_s <= 0
            or len(self._waiting) >= self.limits.requests
            or _now() - self._timed_out_at < wait_s * _DRY_SPELL
            or self._expected_wait_s(len(self._waiting)) > wait_s
        ):
            raise self._refuse(request_id, tokens)
        place: _Waiter = _Waiter(asyncio.get_running_loop().create_future(), tokens)
        self._waiting.append(place)
        try:
            await asyncio.wait((place.ticket,), timeout=wait_s)
        except asyncio.CancelledError:
            self._leave(place)
            raise
        if not place.ticket.done():
            self._leave(place)
            self._timed_out_at = _now()
            raise self._refuse(request_id, tokens)
        return place.ticket.result()

    def _leave(self, place: _Waiter) -> None:
        """A waiter gives up (timed out, or its caller cancelled): out of the queue, and a place
        granted to it in the same instant is given back (it will never be used)."""
        if place.ticket.done():
            place.ticket.result().release()
        else:
            place.ticket.cancel()
            self._waiting.remove(place)

    def _expected_wait_s(self, ahead: int) -> float:
        """How long a newcomer with ``ahead`` waiters in front of it would wait for a place, at
        the rate places were freed lately (0: not known yet — it may wait)."""
        released = self._released_at
        if not released:
            return 0.0
        # NOTE: up to now, not to the last release: a stage that stopped freeing places is slow
        span = _now() - released[0]
        return (ahead + 1) * span / len(released) if span > 0 else 0.0

    @property
    def waiting(self) -> int:
        """Requests waiting for a place (``admit_within``)."""
        return len(self._waiting)

    def _fits(self, tokens: int) -> bool:
        limits = self.limits
        # NOTE: a request alone larger than the token bound is still admitted on an idle stage:
        # the engine's own capacity check (KvCapacityError) judges whether it can ever fit.
        return self.admitted < limits.requests and (
            self.admitted == 0 or self.reserved_tokens + tokens <= limits.tokens
        )

    def _refuse(self, request_id: str, tokens: int) -> ResourceExhaustedError:
        """Count (and log, once per burst) a refusal; the error to raise."""
        limits = self.limits
        metrics.ADMISSION_REFUSED.labels(self.role).inc()
        if not self._refusing:
            self._refusing = True
            log.warning(
                "admission_refusing",
                role=self.role,
                request_id=request_id,
                admitted=self.admitted,
                reserved_tokens=self.reserved_tokens,
                waiting=len(self._waiting),
                max_admitted=limits.requests,
                max_admitted_tokens=limits.tokens,
            )
        kv = (
            f", {self.reserved_tokens} + {tokens} KV tokens reserved (max {limits.tokens})"
            if limits.tokens < sys.maxsize  # NOTE: the gateway bounds requests only
            else ""
        )
        return ResourceExhaustedError(
            f"{self.role} is full: {self.admitted} requests admitted (max {limits.requests})"
            f"{kv}; retry later"
        )

    def _take(self, tokens: int) -> Ticket:
        self._refusing = False
        self.admitted += 1
        self.reserved_tokens += tokens
        return Ticket(self, tokens)

    def _wake(self) -> None:
        """Hand freed places to the waiters at the head of the queue, in order."""
        while self._waiting and self._fits(self._waiting[0].tokens):
            place = self._waiting.popleft()
            place.ticket.set_result(self._take(place.tokens))

    def _release(self, tokens: int) -> None:
        self.admitted -= 1
        self.reserved_tokens -= tokens
        self._released_at.append(_now())
        self._wake()
