"""Configuration of the main_decode service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.kv.receiver import ReceiverConfig
from pdd.server.config import ServerConfig
from pdd.serving.engine_instance import InstanceConfig


@dataclass(frozen=True)
class MainDecodeConfig:
    server: ServerConfig
    instance: InstanceConfig
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    # How long a request waits for its KV before failing.
    kv_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.kv_timeout_s <= 0:
            raise ValueError(f"kv_timeout_s: must be positive, got {self.kv_timeout_s}")
