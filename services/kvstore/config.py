"""Configuration of the kvstore service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.server.config import ServerConfig

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


@dataclass(frozen=True)
class KvstoreConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # redis+cluster://host:port (or rediss+cluster://): a Redis Cluster, any node as the seed.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Namespace of every key, so several stacks (or tests) can share one Redis.
    key_prefix: str = "pdd"
    # Socket (and connect) timeout of every Redis call: how long kvstore waits on a Redis that
    # went away before answering UNAVAILABLE (the gateway then routes from its last known list).
    redis_timeout_s: float = 1.0
    # Connections to Redis, all opened at start and kept: calls beyond them wait (up to
    # redis_timeout_s) for one, so a burst of predictions cannot open sockets without bound and
    # the descriptor count is flat from the start. A Redis Cluster: per node, opened on demand.
    redis_connections: int = 16

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(CLUSTER_SCHEMES + ("redis://", "rediss://", "unix://")):
            raise ValueError(
                "redis_url: expected redis://, rediss://, unix://, redis+cluster:// or "
                f"rediss+cluster://, got {self.redis_url!r}"
            )
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError(f"key_prefix: must be non-empty without ':', got {self.key_prefix!r}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"redis_timeout_s: must be positive, got {self.redis_timeout_s}")
        if self.redis_connections < 1:
            raise ValueError(f"redis_connections: must be >= 1, got {self.redis_connections}")
