"""A supervised stack (``restart="on-failure"``, what ``pdd up`` runs): a service SIGKILLed is
restarted on the address it had, the rest keeps serving, and requests are served again.

Runs its own stack (no relay, to keep it small): each test kills one of its processes. The
MainDecode test forces P-MD so the request must reach the restarted instance; it re-registered
with kvstore before it printed its PDD_LISTENING line.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdd.gen.common.v1 import common_pb2
from pdd.testbed.stack import Stack
from tests.e2e.conftest import make_stack
from tests.e2e.test_pipeline import prompts, run

# Generous: a restart waits its backoff (0.5 s) and then a whole service start on a loaded machine.
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("supervisor"),
        relay=0,
        restart="on-failure",
    )
    yield s
    codes = s.stop()
    # The restarted processes too: each stops cleanly on SIGTERM.
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


async def _restarted(stack: Stack, name: str) -> str:
    """SIGKILL ``name``; wait until a new process of that name listens and the supervisor said
    so; its address."""
    old = stack.by_name(name)
    others = {p.name: p.proc.pid for p in stack.processes if p.name != name}
    old.proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        new = stack.by_name(name)
        said = new.address and f"{name} restarted ({new.address})" in _log(stack)
        if new is not old and new.alive() and said:
            # The rest kept running, untouched.
            assert {p.name: p.proc.pid for p in stack.processes if p.name != name} == others
            return new.address
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} was not restarted within {DEADLINE_S} s")


async def _served(stack: Stack, prompt: list[int], **fields) -> list[int]:
    """One Generate through the gateway; UNAVAILABLE is retried until the deadline.

    NOTE: after kvstore's restart an instance whose lease lapsed meanwhile registers again on
    its next heartbeat (a third of the lease TTL); until then the gateway may find no instance.
    """
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            tokens, _, final = await run(stack, prompt, 8, **fields)
            assert final.stats.main_decode_instance == "main_decode-0"
            return tokens
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def _log(stack: Stack) -> str:
    path = stack.config.log_dir / "supervisor.log"
    return path.read_text() if path.exists() else ""  # written at the first death


async def test_a_killed_main_decode_is_restarted_on_its_address_and_serves(stack):
    prompt = prompts(11, 1)[0]
    before = await _served(stack, prompt, force_pipeline=common_pb2.PIPELINE_P_MD)
    address = stack.by_name("main_decode-0").address
    assert await _restarted(stack, "main_decode-0") == address
    after = await _served(stack, prompt, force_pipeline=common_pb2.PIPELINE_P_MD)
    assert after == before  # greedy: the same tokens from the restarted instance
    log = _log(stack)
    assert "main_decode-0 exited (code -9); restarting in 0.5 s" in log


async def test_a_killed_kvstore_is_restarted_on_its_address_and_requests_route_again(stack):
    prompt = prompts(12, 1)[0]
    before = await _served(stack, prompt)
    address = stack.by_name("kvstore").address
    assert await _restarted(stack, "kvstore") == address
    assert await _served(stack, prompt) == before
    assert "kvstore exited (code -9); restarting in 0.5 s" in _log(stack)
