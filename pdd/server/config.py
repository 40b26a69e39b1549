"""Settings every service's gRPC server shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.server import cpus as cpu_lists
from pdd.server.tls import TlsConfig


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    # 0 picks a free port (tests); the bound port is reported at start-up.
    port: int = 0
    # Seconds in-flight calls get to finish on SIGTERM.
    grace_s: float = 5.0
    max_message_bytes: int = 64 * 1024 * 1024
    log_level: str = "INFO"
    log_json: bool = True
    # Prometheus /metrics port of this process; 0 = off.
    metrics_port: int = 0
    # TLS of the gRPC port, /metrics and every channel the service opens (passed to each).
    tls: TlsConfig = field(default_factory=TlsConfig)
    # The CPUs every thread of the service runs on (``pdd.server.cpus``); None = wherever the OS
    # puts them. An engine role's engine thread moves on to its own ``engine_cpus``.
    cpus: frozenset[int] | None = None

    def __post_init__(self) -> None:
        cpu_lists.check("cpus", self.cpus)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes: must be >= 1024, got {self.max_message_bytes}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in 0..65535, got {self.metrics_port}")
        if not self.host:
            raise ValueError("host: must not be empty")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
