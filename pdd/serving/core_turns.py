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
would for a mixed step in one engine; four ``flock`` calls a step, and a thread of its own for a
wait (``flock`` has no timeout; that thread blocks in it). Across hosts there is nothing
to share and no lock to give. A holder that dies frees its locks with its descriptors; one
stopped mid-step holds them, so a turn waited for longer than ``MAX_WAIT_S`` is taken without the
lock (logged, ``core_turns_timeout``) until the lock comes free again.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)


# How long a step waits for its turn before it runs without one: far longer than any step of a
# live engine. A peer stopped mid-step (SIGSTOP, a hang in a kernel) then slows the host's other
# engines by this once, not forever: every wait has a deadline.
MAX_WAIT_S = 10.0


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
        # A wait that ran out: steps go on without a turn until its waiter got the lock and
        # gave it back (the peer let go).
        self._abandoned: _Waiter | None = None

    @property
    def bypassing(self) -> bool:
        """Stepping without turns: a wait ran out and the lock is still held elsewhere."""
        return self._abandoned is not None and not self._abandoned.done.is_set()

    @contextmanager
    def step(self) -> Iterator[None]:
        t0 = time.monotonic()
        held = False if self.bypassing else self._take()
        if self.on_wait is not None:
            self.on_wait(time.monotonic() - t0)
        try:
            yield
        finally:
            if held:
                fcntl.flock(self._main, fcntl.LOCK_UN)

    def _take(self) -> bool:
        """The main lock through the turnstile; False once ``max_wait_s`` ran out."""
        if self._abandoned is not None:
            self._abandoned = None
            log.info("core_turns_resumed", path=self.path)
        if _try(self._turnstile):  # NOTE: the usual case, no other engine stepping: no thread
            try:
                if _try(self._main):
                    return True
            finally:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        # NOTE: flock has no timeout: a thread of its own blocks in it, this one waits for that
        # thread with one (a poll instead cost ~4 % served: its wake-ups land in the other
        # engine's step, and the turn passed up to a poll late)
        waiter = _Waiter(self._turnstile, self._main)
        threading.Thread(target=waiter.run, name="core-turns", daemon=True).start()
        if waiter.wait(self.max_wait_s):
            return True
        self._abandoned = waiter
        log.warning("core_turns_timeout", path=self.path, waited_s=self.max_wait_s)
        return False

    def close(self) -> None:
        fds, self._turnstile, self._main = (self._turnstile, self._main), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class _Waiter:
    """One blocking take of the turn, on a thread of its own, that its engine may give up on."""

    def __init__(self, turnstile: int, main: int) -> None:
        self.turnstile, self.main = turnstile, main
        self.got = threading.Event()
        self.done = threading.Event()  # taken and, if given up on, given back (or failed)
        self._lock = threading.Lock()
        self._given_up = False

    def run(self) -> None:
        try:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.main, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            with self._lock:
                if self._given_up:
                    fcntl.flock(self.main, fcntl.LOCK_UN)  # NOTE: its engine stepped without
                else:
                    self.got.set()
        except OSError:  # NOTE: the descriptors were closed under it (the service stopping)
            pass
        finally:
            self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """True once the turn is held (for the engine that asked); False if ``timeout_s`` ran
        out first — the waiter then gives the lock back whenever it gets it."""
        if self.got.wait(timeout_s):
            return True
        with self._lock:
            if self.got.is_set():
                return True
            self._given_up = True
            return False


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
