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
would for a mixed step in one engine; four ``flock`` calls a step. Across hosts there is nothing
to share and no lock to give. A holder that dies frees its locks with its descriptors.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CoreTurns:
    """``with turns.step():`` holds this host's engines' turn for one step."""

    def __init__(self, path: str, on_wait: Callable[[float], None] | None = None) -> None:
        """``on_wait(seconds)``: after each turn taken, how long it waited (e.g. a metric)."""
        if not path:
            raise ValueError("core_turns: need a lock file path")
        # NOTE: one descriptor each: flock belongs to the open file, not the process.
        self._turnstile = os.open(f"{path}.turn", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._main = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self.path = path
        self.on_wait = on_wait

    @contextmanager
    def step(self) -> Iterator[None]:
        t0 = time.perf_counter()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        if self.on_wait is not None:
            self.on_wait(time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(self._main, fcntl.LOCK_UN)

    def close(self) -> None:
        fds, self._turnstile, self._main = (self._turnstile, self._main), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
