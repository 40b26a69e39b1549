"""Two clusters on one machine: pin each service's process to its cluster's CPUs.

In the report the two clusters are separate hardware: a relay decoding in the
main cluster takes no cycles from MainDecode in the remote one. On a 2-core
testbed every process would otherwise share both cores, so PDD's extra decoder
(the relay) would slow MainDecode's steps — an artefact of the testbed, not of
the design. With pinning, the main cluster (gateway, kvstore, Redis, prefill,
relay, the bench client) gets the first half of the allowed CPUs and the remote
cluster (MainDecode and the WAN emulator in front of it) the second half; the
contention that remains (relay vs prefill on the main side) is real and is
what ``cpu.CpuMeter`` reports per cluster.

Linux only (``os.sched_setaffinity``); on one CPU, or elsewhere, nothing is pinned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdd.server.cpus import allowed, pin

__all__ = ["pin", "pin_processes", "split_cpus", "allowed_cpus", "cluster_of"]

MAIN, REMOTE = "main", "remote"
# Process-name prefixes (``pdd.testbed.stack`` names: main_decode-0, wan-0) of the remote cluster.
REMOTE_PREFIXES = ("main_decode", "wan-")


def cluster_of(name: str) -> str:
    return REMOTE if name.startswith(REMOTE_PREFIXES) else MAIN


def split_cpus(cpus: Iterable[int]) -> dict[str, set[int]] | None:
    """The main cluster gets the first half (rounded up), the remote the rest; None below 2 CPUs."""
    ordered = sorted(set(cpus))
    if len(ordered) < 2:
        return None
    half = (len(ordered) + 1) // 2
    return {MAIN: set(ordered[:half]), REMOTE: set(ordered[half:])}


def allowed_cpus() -> set[int]:
    return set(allowed())


def pin_processes(pids: Mapping[str, int], cpus: Iterable[int] | None = None) -> dict[str, str]:
    """Pin each named process to its cluster's CPUs; returns name → cluster (empty if nothing was pinned)."""
    split = split_cpus(allowed_cpus() if cpus is None else cpus)
    if split is None:
        return {}
    placed: dict[str, str] = {}
    for name, pid in pids.items():
        cluster = cluster_of(name)
        if pin(pid, split[cluster]):
            placed[name] = cluster
    return placed
