"""CPU use of the stack's processes during a run: how hard the services fight for cores.

Every service is its own process on the same few cores, so a busy relay slows
MainDecode's steps and prefill's chunks. ``CpuMeter`` reads each process's
user + system time from ``/proc/<pid>/stat`` and the machine's busy time from
``/proc/stat`` at the start and end of a run; the difference over the run's
wall time is what each one used, in cores, summed per cluster when the
processes were pinned (``pinning``); the machine's busy time minus ours is what
*other* processes (anything else on the host) took meanwhile. Linux only;
elsewhere (or for a process that exited) the numbers are missing, never made up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # NOTE: the command name (field 2) may hold spaces; fields after its ')' are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            head = f.readline().split()
    except OSError:
        return None
    ticks = [int(x) for x in head[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    total = sum(ticks[:8])  # guest time is already inside user
    return (total - idle) / _TICK, total / _TICK


class CpuMeter:
    """``start()`` … ``stop()`` → cores each named process used in between, and the machine's load."""

    def __init__(self, pids: Mapping[str, int], clusters: Mapping[str, str] | None = None) -> None:
        self.pids = dict(pids)
        # Process name → cluster it was pinned to; empty when nothing was pinned.
        self.clusters = dict(clusters or {})
        self._t0 = 0.0
        self._proc0: dict[str, float | None] = {}
        self._machine0: tuple[float, float] | None = None

    def start(self) -> CpuMeter:
        self._t0 = time.monotonic()
        self._proc0 = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self._machine0 = machine_cpu_s()
        return self

    def stop(self) -> dict:
        """``{"cores", "wall_s", "machine_busy", "total_cores_used", "others_cores", "services": {name: cores},
        "clusters": {cluster: cores}}`` — cores used on average over the run."""
        wall = max(time.monotonic() - self._t0, 1e-9)
        services: dict[str, float | None] = {}
        for name, pid in self.pids.items():
            a, b = self._proc0.get(name), process_cpu_s(pid)
            services[name] = None if a is None or b is None else round((b - a) / wall, 3)
        machine1 = machine_cpu_s()
        busy = None
        if self._machine0 is not None and machine1 is not None and machine1[1] > self._machine0[1]:
            busy = round((machine1[0] - self._machine0[0]) / (machine1[1] - self._machine0[1]), 3)
        used = [v for v in services.values() if v is not None]
        cores = os.cpu_count() or 1
        total = round(sum(used), 3) if used else None
        others = None if busy is None or total is None else round(max(0.0, busy * cores - total), 3)
        clusters: dict[str, float] = {}
        for name, cluster in self.clusters.items():
            if services.get(name) is not None:
                clusters[cluster] = round(clusters.get(cluster, 0.0) + services[name], 3)
        return {
            "cores": cores,
            "wall_s": round(wall, 2),
            "machine_busy": busy,
            "total_cores_used": total,
            "others_cores": others,
            "services": services,
            "clusters": clusters,
        }
