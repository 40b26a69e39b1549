"""Redis unreachable → ``UnavailableError``: kvstore answers UNAVAILABLE with a clear message, fast.

redis-py raises its own ``ConnectionError`` / ``TimeoutError`` (``redis.exceptions``; not the
builtins) when the server is down, restarting (``BusyLoadingError`` is a ``ConnectionError``) or
too slow for the client's socket timeouts. Unmapped, they would reach the client as INTERNAL;
mapped here, the gateway knows the index is down (it routes from its last known instances) and an
instance's membership retries. Any other Redis error stays what it is: a bug, not an outage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdd.core.errors import UnavailableError


def redis_address(redis: Redis | RedisCluster) -> str:
    """Where ``redis`` connects, for messages: host:port, or the unix socket's path (a cluster:
    its startup node, marked so)."""
    if isinstance(redis, RedisCluster):
        node = redis.get_default_node() or next(
            iter(redis.nodes_manager.startup_nodes.values()), None
        )
        return f"cluster {node.host}:{node.port}" if node else "cluster"
    kw = redis.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix:{kw['path']}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


@contextmanager
def redis_outage(where: str) -> Iterator[None]:
    """Re-raise redis-py's connection and timeout errors inside as ``UnavailableError``."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        kind = "timed out" if isinstance(exc, RedisTimeoutError) else "unreachable"
        raise UnavailableError(
            f"prefix index unavailable: Redis at {where} {kind} ({exc}); "
            "retry, or route without predicted hits"
        ) from None
