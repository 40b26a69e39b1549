"""Configuration of the relay service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.kv.fast_link.receiver import FastLinkConfig
from pdd.server.config import ServerConfig
from pdd.serving.engine_instance import InstanceConfig
from pdd.serving.relay import RelayConfig


@dataclass(frozen=True)
class RelayServiceConfig:
    server: ServerConfig
    instance: InstanceConfig
    relay: RelayConfig = field(default_factory=RelayConfig)
    fast_link: FastLinkConfig = field(default_factory=FastLinkConfig)
    # Fast-link transports this relay offers ("auto": RDMA where a device exists, shm, TCP).
    transports: str = "auto"
