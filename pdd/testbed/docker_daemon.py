"""A private Docker daemon: ``dockerd`` that changes nothing outside its own folders.

The compose e2e test and ``make image`` run their own ``dockerd`` (Debian's ``docker.io``) as
root, never the host's: ``--iptables=false --ip6tables=false --bridge=none`` (no NAT rules, no
``docker0``; compose's user-defined bridge networks still work), its own ``--data-root``
(images and layers: kept between runs, the cache), ``--exec-root``/``--pidfile`` and a unix
socket of its own (a fresh temporary folder per start, so two daemons never collide), and an
empty ``--config-file`` (``/etc/docker/daemon.json`` is not read). Published ports reach the
host through ``docker-proxy`` on the addresses the compose file names (127.0.0.1).

Life: ``start()`` launches it and waits until ``docker version`` answers; ``stop()`` sends
SIGTERM (the daemon stops its containers), waits, SIGKILLs the process group if it must, and
removes the exec root. A lock on the data root keeps a second daemon off the same cache: the
second one waits for it up to ``lock_wait_s`` (``make test`` builds the image in the background
while the compose test's daemon waits its turn), then gives up.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.core.errors import UnavailableError


@dataclass(frozen=True)
class DockerDaemonConfig:
    """``data_root``: images and layers (the cache); ``start_timeout_s``: to first answer;
    ``lock_wait_s``: how long to wait for another daemon on the same data root to stop."""

    data_root: Path
    start_timeout_s: float = 60.0
    storage_driver: str = "overlay2"
    lock_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not str(self.data_root):
            raise ValueError("data_root: must be a folder")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.lock_wait_s < 0:
            raise ValueError(f"lock_wait_s: must be >= 0, got {self.lock_wait_s}")


def docker_binaries() -> tuple[str, str]:
    """``dockerd`` and the ``docker`` CLI beside it (the daemon's own version, not another on PATH)."""
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    if dockerd is None:
        raise UnavailableError("dockerd is not installed (apt-get install docker.io)")
    cli = Path(dockerd).resolve().parent.parent / "bin" / "docker"
    if not cli.exists():
        cli = Path(dockerd).resolve().parent / "docker"
    if not cli.exists():
        raise UnavailableError(f"no docker CLI beside {dockerd}")
    return dockerd, str(cli)


class DockerDaemon:
    def __init__(self, config: DockerDaemonConfig) -> None:
        self.config = config
        self.dockerd, self.cli = docker_binaries()
        self._proc: subprocess.Popen | None = None
        self._exec_root: Path | None = None
        self._lock_fd: int | None = None

    @property
    def host(self) -> str:
        """The daemon's ``DOCKER_HOST``."""
        assert self._exec_root is not None, "not started"
        return f"unix://{self._exec_root / 'docker.sock'}"

    def env(self) -> dict[str, str]:
        """The environment for ``docker`` / ``docker-compose`` against this daemon (legacy builder)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        # NOTE: the classic builder: BuildKit needs its own network set-up, and --network host
        # (how a build reaches the package registries here) is plain with the classic one.
        return {**env, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def start(self) -> DockerDaemon:
        root = self.config.data_root
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root.parent / f"{root.name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + self.config.lock_wait_s
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._lock_fd)
                    self._lock_fd = None
                    raise UnavailableError(f"another private dockerd uses {root}") from None
                time.sleep(1.0)
        # NOTE: a short path: the daemon's and containerd's unix sockets live under it (108 bytes).
        self._exec_root = Path(tempfile.mkdtemp(prefix="pdd-dockerd-"))
        (self._exec_root / "daemon.json").write_text("{}\n")
        log = open(self._exec_root / "dockerd.log", "wb")
        self._proc = subprocess.Popen(
            [
                self.dockerd,
                "--config-file",
                str(self._exec_root / "daemon.json"),
                "--data-root",
                str(root),
                "--exec-root",
                str(self._exec_root / "exec"),
                "--pidfile",
                str(self._exec_root / "dockerd.pid"),
                "--host",
                self.host,
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
                "--storage-driver",
                self.config.storage_driver,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.stop()
                raise UnavailableError(f"dockerd exited at start:\n{self.log_tail()}")
            if self.run("version", check=False, timeout=10).returncode == 0:
                return self
            time.sleep(0.3)
        tail = self.log_tail()
        self.stop()
        raise UnavailableError(
            f"dockerd did not answer in {self.config.start_timeout_s} s:\n{tail}"
        )

    def run(
        self, *args: str, check: bool = True, timeout: float = 120, **kwargs
    ) -> subprocess.CompletedProcess:
        """``docker ARGS`` against this daemon; output captured as text unless ``kwargs`` say."""
        options = {"capture_output": True, "text": True, **kwargs}
        return subprocess.run(
            [self.cli, *args], env=self.env(), check=check, timeout=timeout, **options
        )

    def log_tail(self, lines: int = 30) -> str:
        if self._exec_root is None or not (self._exec_root / "dockerd.log").exists():
            return ""
        text = (self._exec_root / "dockerd.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the daemon (and its containers); its exit code, None when it never started."""
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    # NOTE: the group: dockerd's containerd and shims die with it.
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait(10)
            code = self._proc.returncode
            self._proc = None
        if self._exec_root is not None:
            unmount_under(self._exec_root)
            shutil.rmtree(self._exec_root, ignore_errors=True)
            self._exec_root = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return code

    def __enter__(self) -> DockerDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def unmount_under(folder: Path) -> None:
    """Lazily unmount whatever a killed daemon left mounted under ``folder`` (deepest first)."""
    prefix = str(folder.resolve()) + "/"
    mounts = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(prefix)
    ]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
