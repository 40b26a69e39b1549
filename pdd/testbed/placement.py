"""Where a one-host stack's processes run: engine steps on some CPUs, frontends on the rest.

``StackConfig.frontend_cpus`` keeps the last N CPUs this process may use for the gateway,
kvstore, Redis, the WAN emulators and every engine service's event loop (``--cpus``), and gives
the engines' steps the others (``--engine-cpus``): an engine step waits for every core it runs
on, so a frontend that takes one for a moment costs the step the whole moment
(``pdd.server.cpus``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.server import cpus as cpu_lists

# The services whose engine steps run on the engine CPUs.
ENGINE_MODULES = ("services.prefill", "services.relay", "services.main_decode")
# Processes that take no ``--cpus`` flag: pinned by pid once started.
UNFLAGGED_MODULES = ("services.wan_link",)


@dataclass(frozen=True)
class Placement:
    engine: frozenset[int]
    frontend: frozenset[int]

    @classmethod
    def keeping(cls, frontend_cpus: int) -> Placement | None:
        """The last ``frontend_cpus`` allowed CPUs for the frontends (ValueError if that leaves
        the engines none); None for 0."""
        if not frontend_cpus:
            return None
        engine, frontend = cpu_lists.split(cpu_lists.allowed(), frontend_cpus)
        return cls(engine, frontend)

    def flags(self, module: str) -> list[str]:
        """What ``python -m module`` is started with."""
        if module in UNFLAGGED_MODULES:
            return []
        flags = ["--cpus", cpu_lists.format_cpus(self.frontend)]
        if module in ENGINE_MODULES:
            flags += ["--engine-cpus", cpu_lists.format_cpus(self.engine)]
        return flags

    def pin_frontend(self, pid: int) -> bool:
        """A started process that took no flag (Redis, a WAN emulator) onto the frontend CPUs."""
        return cpu_lists.pin(pid, self.frontend)
