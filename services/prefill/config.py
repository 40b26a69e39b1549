"""Configuration of the prefill service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.server.config import ServerConfig
from pdd.serving.engine_instance import InstanceConfig
from pdd.serving.prefill import PrefillConfig


@dataclass(frozen=True)
class PrefillServiceConfig:
    server: ServerConfig
    instance: InstanceConfig
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
