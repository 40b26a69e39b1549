"""Start PDD processes and learn where they listen.

Every service prints ``PDD_LISTENING <name> <host:port>`` once it is SERVING
(see ``pdd.server.bootstrap``); the launcher starts ``python -m services.X``
with port 0, reads that line, and keeps the process. Used by ``pdd up`` and
by the end-to-end tests, so both exercise the same entry points the
deployment files use. ``spawn_module`` returns at once (the supervisor's
restarts); ``start_module`` also waits for the line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    # What started it: ``python -m module *args`` (a restart runs it again, its port pinned).
    module: str = ""
    args: tuple[str, ...] = ()
    # Set once the PDD_LISTENING line was read (``address`` is then known) or the output ended.
    _settled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_listening(self, timeout: float) -> bool:
        """Wait for the PDD_LISTENING line; False when it did not come (exited or timed out)."""
        self._settled.wait(timeout)
        return bool(self.address)

    def stop(self, timeout: float = 30.0) -> int:
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


def _pump(stream, sink, p: Process) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if not p.address and line.startswith(LISTEN_PREFIX):
            p.address = line.split()[2]
            p._settled.set()
        sink.write(line)
        sink.flush()
    sink.close()
    p._settled.set()


def spawn_module(
    name: str,
    module: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> Process:
    """Run ``python -m module args``; its ``address`` is filled in once it listens."""
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
    p = Process(name, proc, "", log_path, module=module, args=tuple(args))
    p._log_thread = threading.Thread(target=_pump, args=(proc.stdout, sink, p), daemon=True)
    p._log_thread.start()
    return p


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
    p = spawn_module(name, module, args, env=env, log_dir=log_dir)
    if not p.wait_listening(timeout):
        p.stop(timeout=5)
        log_path = p.log_path
        assert log_path is not None
        tail = log_path.read_text()[-3000:]
        # NOTE: the first line stands alone (the CLI prints only it): the reason, then the log.
        raise UnavailableError(
            f"{name} did not start (exit {p.proc.returncode}): {_last_reason(tail)}; "
            f"log {log_path}\n{tail}"
        )
    return p


def _last_reason(log_text: str) -> str:
    """A failed service's last log line, shortened: a JSON line's error (or event) alone."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    if not lines:
        return "no output"
    last = lines[-1].strip()
    try:
        record = json.loads(last)
    except ValueError:
        record = None
    if isinstance(record, dict):
        last = str(record.get("error") or record.get("event") or last)
    return last if len(last) <= 300 else last[:297] + "..."


def pinned_args(module: str, args: tuple[str, ...], address: str) -> list[str]:
    """``args`` with every listen port replaced by the one ``address`` bound (a restart's flags).

    NOTE: a service started with port 0 would get a new port on a restart; its peers, the WAN
    emulator's upstream and kvstore's registry know only the old one.
    """
    flag, value = ("--listen", address) if module == "services.wan_link" else ("--port", "")
    value = value or address.rpartition(":")[2]
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == flag:
            out[i + 1] = value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
