"""The whole stack, each service its own process, for the end-to-end tests.

One stack per module (starting seven processes costs seconds): a tiny random
model (block size 4, so hits and deltas are visible at small sizes), a real
Redis, the WAN emulator between the clusters.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from pdd.bench.engine_probe import EngineProbe
from pdd.testbed.stack import LinkSettings, Stack, StackConfig

TINY = "tiny:7,ctx=512"
BLOCK = 4


def make_stack(
    redis_url: str,
    tmp_path,
    *,
    wan: LinkSettings = LinkSettings(),
    extra_engine=(),
    gateway_flags=(),
    **config: object,
) -> Stack:
    """A started stack of the tiny model; ``config``: more StackConfig fields (model,
    main_decode=2, relay=0, http_port, restart, key_prefix, ...)."""
    config.setdefault("key_prefix", f"e2e{uuid.uuid4().hex[:8]}")
    config.setdefault("model", TINY)
    stack_config = StackConfig(
        redis_url=redis_url,
        gateway_port=0,
        wan=wan,
        engine_flags=(
            "--block-size",
            str(BLOCK),
            "--kv-cache-mb",
            "32",
            "--threads",
            "1",
            "--lease-ttl-ms",
            "3000",
            *extra_engine,
        ),
        gateway_flags=("--seed", "0", *gateway_flags),
        log_dir=tmp_path / "logs",
        **config,
    )
    return Stack(stack_config).start()


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    s = make_stack(redis_url, tmp_path_factory.mktemp("stack"))
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


async def no_kv_held(stack, rid: str, timeout_s: float = 10.0) -> None:
    """Every engine frees the request's KV (MainDecode once the cancellation crossed the WAN)."""
    deadline = time.monotonic() + timeout_s
    while (held := await EngineProbe(stack).holding([rid])) and any(held.values()):
        assert time.monotonic() < deadline, f"KV of {rid} still held: {held}"
        await asyncio.sleep(0.2)


def logged(proc, rid: str, event: str) -> list[dict]:
    """The JSON log lines of ``proc`` for request ``rid`` with event ``event``."""
    out = []
    for line in proc.log_path.read_text().splitlines():
        if rid in line and f'"{event}"' in line:
            out.append(json.loads(line))
    return out
