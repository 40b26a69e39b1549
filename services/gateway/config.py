"""Configuration of the gateway service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.routing.policy import RoutingConfig
from pdd.server.config import ServerConfig


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    kvstore_address: str = "127.0.0.1:50051"
    # Model spec (name, path or tiny:SEED); the gateway loads only its tokenizer and config.
    model: str = "smollm2"
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # OpenAI-compatible HTTP port; 0 disables it.
    http_port: int = 0
    stage_timeout_s: float = 600.0
    # Seed of the router's tie-breaks (None: nondeterministic).
    seed: int | None = None

    def __post_init__(self) -> None:
        if ":" not in self.kvstore_address:
            raise ValueError(f"kvstore_address: expected host:port, got {self.kvstore_address!r}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port: must be in 0..65535, got {self.http_port}")
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s: must be positive, got {self.stage_timeout_s}")
