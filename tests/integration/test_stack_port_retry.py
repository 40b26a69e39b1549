"""The testbed stack retries a service whose /metrics port was taken between being found free and
being bound (an outgoing connection's ephemeral port can take it: CI saw kvstore fail so)."""

from __future__ import annotations

import socket

import pytest

from pdd.core.errors import UnavailableError
from pdd.testbed import stack as stack_mod
from pdd.testbed.launcher import free_port
from pdd.testbed.stack import Stack, StackConfig


def _kvstore(stack: Stack, redis_url: str):
    return stack._start(
        "kvstore",
        "services.kvstore",
        ["--port", "0", "--redis-url", redis_url, "--key-prefix", "t"],
    )


def test_a_taken_metrics_port_is_retried_on_another(tmp_path, redis_url, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        monkeypatch.setattr(stack_mod, "free_port", lambda: next(picks, None) or free_port())
        stack = Stack(StackConfig(log_dir=tmp_path, start_timeout_s=60))
        try:
            kv = _kvstore(stack, redis_url)
            assert kv.proc.poll() is None
            assert stack.metrics["kvstore"] != f"127.0.0.1:{busy}"
        finally:
            stack.stop()


def test_a_port_taken_on_every_try_still_fails_with_the_reason(tmp_path, redis_url, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(stack_mod, "free_port", lambda: busy)
        stack = Stack(StackConfig(log_dir=tmp_path, start_timeout_s=60))
        try:
            with pytest.raises(UnavailableError, match="Address already in use"):
                _kvstore(stack, redis_url)
        finally:
            stack.stop()
