"""One private dockerd per data root (``pdd.testbed.docker_daemon``): a second one waits up to
``lock_wait_s`` for the first to stop (``make test``'s background image build and the compose
test's daemon share the cache), then gives up with a clear error. No daemon is started here."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from pdd.core.errors import UnavailableError
from pdd.testbed.docker_daemon import DockerDaemon, DockerDaemonConfig


def _daemon(tmp_path, lock_wait_s: float) -> DockerDaemon:
    try:
        return DockerDaemon(
            DockerDaemonConfig(data_root=tmp_path / "data", lock_wait_s=lock_wait_s)
        )
    except UnavailableError as exc:
        pytest.skip(str(exc))  # no dockerd on this machine: nothing to lock


def _hold(tmp_path) -> int:
    (tmp_path / "data").mkdir(exist_ok=True)
    fd = os.open(tmp_path / "data.lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_second_daemon_on_the_same_data_root_waits_then_gives_up(tmp_path):
    held = _hold(tmp_path)
    daemon = _daemon(tmp_path, lock_wait_s=1.0)
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="another private dockerd uses"):
        daemon.start()
    assert time.monotonic() - start >= 1.0  # it waited its lock_wait_s before giving up
    assert daemon._lock_fd is None  # and kept no descriptor
    os.close(held)


def test_the_wait_ends_when_the_first_daemon_lets_go(tmp_path):
    held = _hold(tmp_path)
    threading.Timer(0.5, os.close, (held,)).start()  # the first daemon stops
    daemon = _daemon(tmp_path, lock_wait_s=30.0)
    # NOTE: once the lock is taken, start() goes on to launch dockerd: stop at that point
    daemon.dockerd = "/nonexistent/dockerd"
    with pytest.raises(FileNotFoundError):
        daemon.start()
    assert daemon._lock_fd is not None  # it got the lock
    daemon.stop()
    assert daemon._lock_fd is None


def test_lock_wait_is_not_negative(tmp_path):
    with pytest.raises(ValueError, match="^lock_wait_s:"):
        DockerDaemonConfig(data_root=tmp_path, lock_wait_s=-1)
