"""``pdd up --frontend-cpus``: the engines' steps on their CPUs, every other thread off them.

A stack of the tiny model with one CPU kept for the frontends serves P-MD and pipeline MD
requests; then every thread of every service is read back from ``/proc``: the gateway, kvstore
and the WAN emulator only on the frontend CPU, each engine service's event loop there too, and
the thread that stepped its engine (and any OpenMP thread it started) only on the engine CPUs.
The outputs stay what an unplaced stack gives (greedy, the same engine).
"""

from __future__ import annotations

import os

import pytest

from pdd.client import generate_stream
from pdd.gen.common.v1 import common_pb2
from pdd.server import cpus as cpu_lists
from tests.e2e.conftest import make_stack

pytestmark = pytest.mark.skipif(
    len(cpu_lists.allowed()) < 2, reason="placement needs two CPUs this process may use"
)


def _threads(pid: int) -> dict[int, tuple[frozenset[int], int]]:
    """tid → (the CPUs it may run on, its CPU ticks so far)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        tid = int(t)
        try:
            stat = open(f"/proc/{pid}/task/{t}/stat").read()
        except OSError:
            continue  # NOTE: a thread that ended while we looked
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (frozenset(os.sched_getaffinity(tid)), int(fields[11]) + int(fields[12]))
    return out


async def _serve(stack, pipeline) -> list[int]:
    tokens = []
    async for resp in generate_stream(
        stack.gateway.address,
        list(range(5, 45)),
        max_tokens=24,
        timeout=120,
        ignore_eos=True,
        force_pipeline=pipeline,
    ):
        tokens.extend(resp.token_ids)
    return tokens


async def test_engine_steps_on_engine_cpus_and_the_rest_off_them(redis_url, tmp_path):
    stack = make_stack(redis_url, tmp_path, frontend_cpus=1, relay=0)
    try:
        engine, frontend = stack.placement.engine, stack.placement.frontend
        assert engine and frontend and not engine & frontend
        p_md = await _serve(stack, common_pb2.PIPELINE_P_MD)
        md = await _serve(stack, common_pb2.PIPELINE_MD)
        assert len(p_md) == len(md) == 24
        for p in stack.processes:
            threads = _threads(p.proc.pid)
            if p.module in ("services.prefill", "services.main_decode"):
                # NOTE: the service's own threads (its event loop first) on the frontend CPU;
                # the engine thread (it loaded the model and stepped) on the engine CPUs.
                assert threads[p.proc.pid][0] == frontend, p.name
                stepping = [ticks for cpus, ticks in threads.values() if cpus == engine]
                assert stepping and max(stepping) > 0, (p.name, threads)
                assert {cpus for cpus, _ in threads.values()} == {engine, frontend}, p.name
            else:
                assert {cpus for cpus, _ in threads.values()} == {frontend}, (p.name, threads)
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


async def test_placed_and_unplaced_stacks_answer_alike(redis_url, tmp_path):
    placed = make_stack(redis_url, tmp_path / "placed", frontend_cpus=1, relay=0)
    try:
        got = await _serve(placed, common_pb2.PIPELINE_P_MD)
    finally:
        placed.stop()
    plain = make_stack(redis_url, tmp_path / "plain", relay=0)
    try:
        want = await _serve(plain, common_pb2.PIPELINE_P_MD)
    finally:
        plain.stop()
    assert got == want
