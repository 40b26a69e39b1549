"""The guarded relay under saturation, every service its own process: a relay capped at 2
requests and 12 concurrent low-hit requests that would all go through it under θ. Nothing fails,
the relay never holds more than 2 requests at once (its own log), the relay's share of the
tokens stays bounded, and the gateway counts every request it kept off the full relay."""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import re
import urllib.request

import pytest

from pdd.client import generate_stream
from pdd.gen.common.v1 import common_pb2
from tests.e2e.conftest import make_stack

CAP, REQUESTS, MAX_TOKENS = 2, 12, 48


@pytest.fixture(scope="module")
def guarded(redis_url, tmp_path_factory):
    s = make_stack(
        redis_url,
        tmp_path_factory.mktemp("guarded"),
        # NOTE: θ, so that every cold request wants the relay; the guard alone keeps them off.
        gateway_flags=("--pipeline-policy", "threshold", "--relay-max-requests", str(CAP)),
    )
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


async def _one(stack, prompt, rid):
    final = None
    n = 0
    async for resp in generate_stream(
        stack.gateway.address,
        prompt,
        max_tokens=MAX_TOKENS,
        timeout=180,
        ignore_eos=True,
        request_id=rid,
    ):
        n += len(resp.token_ids)
        if resp.HasField("stats"):
            final = resp.stats
    assert final is not None and n == MAX_TOKENS
    return final


def _relay_full_count(stack) -> float:
    with urllib.request.urlopen(f"http://{stack.metrics['gateway']}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^pdd_router_relay_full_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _relay_intervals(stack, rids) -> list[tuple[float, float]]:
    """[start, end] of each relay Decode call of ``rids``, from the relay's own log."""
    out = []
    for line in stack.by_name("relay-0").log_path.read_text().splitlines():
        if '"rpc_finished"' not in line:
            continue
        d = json.loads(line)
        if d.get("rpc") != "Decode" or d.get("request_id") not in rids:
            continue
        end = datetime.datetime.fromisoformat(d["timestamp"]).timestamp()
        out.append((end - d["ms"] / 1000, end))
    return out


def _max_overlap(intervals, eps=0.002) -> int:
    edges = sorted([(s + eps, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def test_a_saturated_relay_stays_capped_and_nothing_fails(guarded):
    rng = random.Random(15)
    before = _relay_full_count(guarded)
    rids = [f"guard-{i}" for i in range(REQUESTS)]
    # cold prompts (nothing cached anywhere): θ would send every one through the relay
    prompts = [[rng.randrange(1, 256) for _ in range(48)] for _ in range(REQUESTS)]
    stats = await asyncio.gather(*(_one(guarded, p, rid) for p, rid in zip(prompts, rids)))

    through_relay = [s for s in stats if s.pipeline == common_pb2.PIPELINE_P_RLD_MD]
    p_md = [s for s in stats if s.pipeline == common_pb2.PIPELINE_P_MD]
    assert len(through_relay) + len(p_md) == REQUESTS
    assert 1 <= len(through_relay) < REQUESTS and p_md, [s.pipeline for s in stats]
    # every request kept off the relay was counted (and only those)
    assert _relay_full_count(guarded) - before == len(p_md)
    # the relay never held more than its cap at once
    await asyncio.sleep(0.5)  # the relay's last log lines
    intervals = _relay_intervals(guarded, set(rids))
    assert len(intervals) == len(through_relay)
    assert _max_overlap(intervals) <= CAP
    # the relay's token share stays bounded: at most CAP of the REQUESTS decode there at once
    relay_tokens = sum(s.rld_tokens for s in stats)
    share = relay_tokens / sum(s.completion_tokens for s in stats)
    print(
        f"relay: {len(through_relay)} requests, peak {_max_overlap(intervals)}, share {share:.3f}"
    )
    assert share <= 0.25, f"relay produced {relay_tokens} tokens, share {share:.2f}"
