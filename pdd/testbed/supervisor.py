"""The stack's supervisor: a service that dies is restarted, the rest keeps serving.

``Supervisor.run`` polls the stack's processes (and its embedded Redis); a process that exited
non-zero is announced (``<name> exited (code N); restarting in X s``), started again after a
backoff (``Backoff``: doubling, capped, forgotten once it stayed up a while) with its command
line and the address it had (``Stack.restart``), and announced again once it listens
(``<name> restarted``). A process that exited 0 asked to stop: it is not restarted. Every line
goes to ``say`` (``pdd up`` prints it) and to the supervisor's log file.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdd.core.errors import PddError
from pdd.testbed.launcher import Process

REDIS = "redis"


class Supervised(Protocol):
    """What the supervisor needs of a stack (``pdd.testbed.stack.Stack``)."""

    processes: list[Process]
    redis: subprocess.Popen | None
    redis_url: str

    def restart(self, name: str) -> Process: ...

    def restart_redis(self) -> None: ...


@dataclass(frozen=True)
class Backoff:
    """How long to wait before a restart: ``base_s`` doubling per failure up to ``max_s``."""

    base_s: float = 0.5
    max_s: float = 10.0
    # A process that stayed up this long has its failure count forgotten.
    reset_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("base_s", "max_s", "reset_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_s < self.base_s:
            raise ValueError(f"max_s: must be >= base_s ({self.base_s}), got {self.max_s}")

    def delay(self, failures: int) -> float:
        """The wait before the restart after ``failures`` earlier ones in a row (0: the first)."""
        if failures < 0:
            raise ValueError(f"failures: must be >= 0, got {failures}")
        # NOTE: the exponent is capped so a long-failing service cannot overflow the float.
        return min(self.max_s, self.base_s * 2.0 ** min(failures, 64))


@dataclass
class _Unit:
    """One supervised process's restart state."""

    started_at: float
    failures: int = 0
    restart_at: float | None = None
    # Restarted, its PDD_LISTENING line not yet seen.
    starting: bool = False
    # An exit already announced that will not be restarted (code 0).
    settled: bool = False


class Supervisor:
    def __init__(
        self,
        stack: Supervised,
        *,
        backoff: Backoff | None = None,
        say: Callable[[str], None] = print,
        log_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.backoff = backoff or Backoff()
        self._say = say
        self._log_path = log_path
        self._clock = clock
        self._units: dict[str, _Unit] = {}

    def run(self, stop: threading.Event, poll_s: float = 0.25) -> None:
        """Supervise until ``stop`` is set."""
        while not stop.wait(poll_s):
            self.step(stop)

    def step(self, stop: threading.Event | None = None) -> None:
        """One look at every process: announce deaths, restart those whose backoff is over."""
        now = self._clock()
        for p in list(self.stack.processes):
            if stop is not None and stop.is_set():
                return  # NOTE: stopping: an exit now is the shutdown, never a failure
            unit = self._units.setdefault(p.name, _Unit(started_at=now))
            if unit.starting and p.address:
                unit.starting = False
                self._note(f"{p.name} restarted ({p.address})")
            if p.alive():
                continue
            unit.starting = False
            self._on_dead(p.name, p.proc.returncode, unit, now, lambda n=p.name: self._restart(n))
        redis = self.stack.redis
        if redis is not None and redis.poll() is not None and not (stop and stop.is_set()):
            unit = self._units.setdefault(REDIS, _Unit(started_at=now))
            self._on_dead(REDIS, redis.returncode, unit, now, self._restart_redis)

    def _on_dead(
        self, name: str, code: int, unit: _Unit, now: float, restart: Callable[[], None]
    ) -> None:
        if unit.settled:
            return
        if unit.restart_at is None:
            if code == 0:
                unit.settled = True
                self._note(f"{name} exited (code 0); not restarted")
                return
            if now - unit.started_at >= self.backoff.reset_after_s:
                unit.failures = 0
            delay = self.backoff.delay(unit.failures)
            unit.failures += 1
            unit.restart_at = now + delay
            self._note(f"{name} exited (code {code}); restarting in {delay:g} s")
            return
        if now >= unit.restart_at:
            unit.restart_at = None
            unit.started_at = now
            try:
                restart()
            except (OSError, PddError) as exc:  # it counts as one more failure on the next look
                self._note(f"{name} restart failed: {exc}")

    def _restart(self, name: str) -> None:
        self.stack.restart(name)
        self._units[name].starting = True

    def _restart_redis(self) -> None:
        self.stack.restart_redis()
        self._note(f"{REDIS} restarted ({self.stack.redis_url})")

    def _note(self, line: str) -> None:
        self._say(line)
        if self._log_path is not None:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            with open(self._log_path, "a") as log:
                log.write(f"{stamp} {line}\n")
