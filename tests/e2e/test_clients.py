"""The polyglot clients against a live stack: the Python ``pdd-client`` (torch and ``pdd``
unimportable) and the Node.js client (``clients/node``, its own ``npm test``) stream the same
greedy completion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CLIENT_PY = ROOT / "clients" / "python"
CLIENT_NODE = ROOT / "clients" / "node"
PROMPT = [5, 17, 33, 2, 99, 41, 8, 120, 64]
MAX_TOKENS = 10


def python_client(
    address: str, prompt: list[int], extra_env: dict[str, str] | None = None
) -> list[dict]:
    """``pdd-client --json`` under ``python -I`` with torch and the server package blocked."""
    code = f"""
import sys
sys.modules["torch"] = None
sys.modules["pdd"] = None
sys.path.insert(0, {str(CLIENT_PY)!r})
from pdd_client.__main__ import main
rc = main(["--address", {address!r}, "--prompt-token-ids", {",".join(map(str, prompt))!r},
           "--max-tokens", "{MAX_TOKENS}", "--ignore-eos", "--json"])
assert "torch" not in sys.modules or sys.modules["torch"] is None
sys.exit(rc)
"""
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(extra_env or {})},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def node_test(address: str, expected: list[int], extra_env: dict[str, str] | None = None) -> str:
    """Run clients/node's ``npm test`` against ``address``; its output (every test must pass, none skip)."""
    npm = shutil.which("npm")
    if npm is None or not (CLIENT_NODE / "node_modules" / "@grpc" / "grpc-js").exists():
        if os.environ.get("CI"):
            pytest.fail("the Node client's dependencies are missing (make clients installs them)")
        pytest.skip("npm or clients/node/node_modules missing; `make clients` installs them")
    env = {
        **os.environ,
        "PDD_GATEWAY": address,
        "PDD_PROMPT_TOKEN_IDS": ",".join(map(str, PROMPT)),
        "PDD_EXPECTED_TOKEN_IDS": ",".join(map(str, expected)),
        **(extra_env or {}),
    }
    out = subprocess.run(
        [npm, "test", "--silent"],
        cwd=CLIENT_NODE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "# fail 0" in text and "# skipped 0" in text and "# pass 4" in text, text
    return text


def tokens_of(messages: list[dict]) -> list[int]:
    return [t for m in messages for t in m.get("token_ids", [])]


def test_python_client_streams_without_torch(stack):
    messages = python_client(stack.gateway.address, PROMPT)
    tokens = tokens_of(messages)
    assert len(tokens) == MAX_TOKENS
    final = messages[-1]
    assert final["finish_reason"] == "FINISH_REASON_LENGTH"
    assert final["stats"]["completion_tokens"] == MAX_TOKENS
    assert final["stats"]["prompt_tokens"] == len(PROMPT)


def test_node_client_streams_the_same_completion(stack):
    expected = tokens_of(python_client(stack.gateway.address, PROMPT))
    node_test(stack.gateway.address, expected)
