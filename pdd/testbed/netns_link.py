"""Kernel bandwidth shaping for the testbed: ``tc tbf`` inside a network namespace.

This kernel has no ``netem`` (so no kernel delay), but a token-bucket filter
works inside a namespace. ``TbfNamespace`` creates a fresh namespace, brings
its loopback up (Ethernet MTU) and shapes it with ``tbf``; processes started with
``ns.command([...])`` talk over that shaped loopback. Delay and jitter stay with
the userspace ``LinkEmulator``, which can run inside the namespace too.

Needs root and a working ``ip netns`` (``tbf_available()`` says); the namespace
is deleted on exit, whatever happened.

NOTE: loopback is one device, so both directions share the one bucket (the
reverse direction of a bulk transfer is only ACKs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

from pdd.core.errors import UnavailableError


@dataclass(frozen=True)
class TbfConfig:
    mbps: float
    burst_kib: int = 64
    # Longest a packet may wait in the bucket before tbf drops it.
    latency_ms: float = 200.0

    def __post_init__(self) -> None:
        if not self.mbps > 0:
            raise ValueError(f"mbps: must be positive, got {self.mbps}")
        if self.burst_kib <= 0:
            raise ValueError(f"burst_kib: must be positive, got {self.burst_kib}")
        if not self.latency_ms > 0:
            raise ValueError(f"latency_ms: must be positive, got {self.latency_ms}")


def tbf_available() -> bool:
    """Root, ``ip`` and ``tc`` present, and a namespace can actually be made here."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"pddprobe{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


class TbfNamespace:
    def __init__(self, config: TbfConfig, *, name: str | None = None) -> None:
        self.config = config
        self.name = name or f"pdd{uuid.uuid4().hex[:10]}"
        self._made = False

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise UnavailableError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def __enter__(self) -> TbfNamespace:
        self._run(["ip", "netns", "add", self.name])
        self._made = True
        try:
            # NOTE: loopback's 64 KiB MTU exceeds the bucket; tbf would drop every full packet.
            self._run(self.command(["ip", "link", "set", "lo", "mtu", "1500", "up"]))
            c = self.config
            self._run(
                self.command(
                    [
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        "lo",
                        "root",
                        "tbf",
                        "rate",
                        f"{c.mbps}mbit",
                        "burst",
                        f"{c.burst_kib}kb",
                        "latency",
                        f"{c.latency_ms}ms",
                    ]
                )
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._made = False
