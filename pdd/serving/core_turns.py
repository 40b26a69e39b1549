"""``CoreTurns``: engines of one host that share its cores take turns at their steps.

An engine step runs an OpenMP team in lock-step on every core it has. When prefill and
MainDecode (and a relay) sit on the same host and step at the same time, their teams
oversubscribe the cores: each parallel region waits for a thread the other team has
descheduled, and both steps take longer than one after the other would. Measured on the 2-core
testbed, MainDecode decoding a burst's first half while prefill computes its second half:
MainDecode's CPU a token 2.67 ms against 2.08 apart; served P-MD with turns against without, one
run, every round better: 1.10× at 16 concurrent, 1.04× at 32 (``pdd bench served --b-env``).
One process serving both roles does the same by construction: its one engine runs one step
at a time, a prefill chunk and the decode batch together.

How: every engine service given the same lock file (``--core-turns PATH``, ``pdd up`` gives
its engines one) holds an exclusive ``flock`` on it for the length of each step. A waiting
engine first takes a second lock, the turnstile (``PATH.turn``), and keeps it until it holds
the main one, so an engine that steps back to back cannot take the main lock again while
another waits: two engines alternate step by step. What it costs: a decoding request waits out
the other engine's step (a prefill step of a 2,048-token burst is ~0.4 s on the testbed), as it
would for a mixed step in one engine; four ``flock`` calls a step, and a turn passes up to 1 ms
late (``flock`` has no timeout, so a held lock is polled, backing off). Across hosts there is nothing
to share and no lock to give. A holder that dies frees its locks with its descriptors; one
stopped mid-step holds them, so a turn waited for longer than ``MAX_WAIT_S`` is taken without the
lock (logged, ``core_turns_timeout``) until the lock comes free again.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)


# How long a step waits for its turn before it runs without one: far longer than any step of a
# live engine. A peer stopped mid-step (SIGSTOP, a hang in a kernel) then slows the host's other
# engines by this once, not forever: every wait has a deadline.
MAX_WAIT_S = 10.0
# Polls of a held lock back off from 50 us to this (flock has no timeout): a turn passes at most
# this late, ~1,000 wake-ups a second while another engine steps.
_POLL_MAX_S = 0.001


class CoreTurns:
    """``with turns.step():`` holds this host's engines' turn for one step."""

    def __init__(
        self,
        path: str,
        on_wait: Callable[[float], None] | None = None,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        """``on_wait(seconds)``: after each turn taken, how long it waited (e.g. a metric)."""
        if not path:
            raise ValueError("core_turns: need a lock file path")
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s: must be > 0, got {max_wait_s}")
        # NOTE: one descriptor each: flock belongs to the open file, not the process.
        self._turnstile = os.open(f"{path}.turn", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._main = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self.path = path
        self.on_wait = on_wait
        self.max_wait_s = max_wait_s
        # A wait ran out: steps go on without a turn (one try each) until the lock comes free.
        self.bypassing = False

    @contextmanager
    def step(self) -> Iterator[None]:
        t0 = time.monotonic()
        held = _try(self._main) if self.bypassing else self._take(t0 + self.max_wait_s)
        if self.on_wait is not None:
            self.on_wait(time.monotonic() - t0)
        if held and self.bypassing:
            self.bypassing = False
            log.info("core_turns_resumed", path=self.path)
        elif not held and not self.bypassing:
            self.bypassing = True
            log.warning("core_turns_timeout", path=self.path, waited_s=self.max_wait_s)
        try:
            yield
        finally:
            if held:
                fcntl.flock(self._main, fcntl.LOCK_UN)

    def _take(self, deadline: float) -> bool:
        """The main lock through the turnstile, by ``deadline``; False if it ran out."""
        if not _poll(self._turnstile, deadline):
            return False
        try:
            return _poll(self._main, deadline)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        fds, self._turnstile, self._main = (self._turnstile, self._main), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _poll(fd: int, deadline: float) -> bool:
    pause = 50e-6
    while not _try(fd):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)
    return True
