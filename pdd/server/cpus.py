"""Which CPUs a service's threads run on (Linux CPU lists such as ``0-3,8``).

An engine step runs on every core it is given, in lock-step (OpenMP): when another process
takes one of those cores for a moment, the whole step waits for it. On one host the gateway,
kvstore, the WAN emulator and a service's own event loop take such moments every token, so
what they cost the engine is about twice their CPU (``docs/engine-performance.md``, "Cores
shared with the frontends"). vLLM's CPU server answers this by reserving cores for its
frontend (``VLLM_CPU_NUM_OF_RESERVED_CPU``); here a service's ``--cpus`` keeps all its
threads on a set, and an engine role's ``--engine-cpus`` puts its engine thread and the
OpenMP team that thread starts on another, so the frontends never preempt a step.

Linux only (``os.sched_setaffinity``): elsewhere a list is refused when a service starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-3,8"`` → {0, 1, 2, 3, 8}; ValueError on anything else (empty, reversed, negative)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"expected a CPU list such as 0-3,8, got {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"expected a CPU list such as 0-3,8, got {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} → ``"0-3,8"`` (what ``parse_cpus`` reads)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed() -> frozenset[int]:
    """The CPUs this process may run on (empty where the platform cannot say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return frozenset(getter(0)) if getter is not None else frozenset()


def check(field: str, cpus: frozenset[int] | None) -> None:
    """ValueError naming ``field`` unless ``cpus`` is None or a non-empty subset of ``allowed``."""
    if cpus is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{field}: CPU placement needs Linux (sched_setaffinity)")
    if not cpus:
        raise ValueError(f"{field}: no CPU named")
    outside = cpus - allowed()
    if outside:
        raise ValueError(
            f"{field}: CPU {format_cpus(outside)} not among this process's {format_cpus(allowed())}"
        )


def place(cpus: frozenset[int] | None) -> None:
    """Keep the calling thread on ``cpus`` (None: leave it); threads it starts later inherit."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def place_process(cpus: frozenset[int] | None) -> None:
    """Every thread this process has now on ``cpus`` (None: leave them), those started by an
    import included; threads started later inherit their starter's."""
    if cpus is not None:
        pin(os.getpid(), cpus)


def pin(pid: int, cpus: Iterable[int]) -> bool:
    """Move every thread ``pid`` has now to ``cpus`` (a process this one started, such as
    redis-server); False where one cannot be moved. Threads it starts later inherit."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    ok = True
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cpus))
        except (OSError, AttributeError):
            ok = False
    return ok


def split(total: Iterable[int], frontend: int) -> tuple[frozenset[int], frozenset[int]]:
    """(engine CPUs, frontend CPUs): the last ``frontend`` of ``total`` for the frontends.

    ValueError unless at least one CPU is left for the engines."""
    ordered = sorted(set(total))
    if frontend < 1 or frontend >= len(ordered):
        raise ValueError(
            f"frontend_cpus: must be 1..{len(ordered) - 1} on {len(ordered)} CPUs "
            f"({format_cpus(ordered)}), got {frontend}"
        )
    return frozenset(ordered[:-frontend]), frozenset(ordered[-frontend:])
