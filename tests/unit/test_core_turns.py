"""``CoreTurns``: engines sharing a host's cores step one at a time, alternating, across
processes; an ``EngineLoop`` given turns steps only while it holds one."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from pdd.serving.core_turns import CoreTurns
from pdd.serving.engine_loop import EngineLoop
from tests.unit.test_engine_runner import SlowEngine, _drain


def _free(fd: int) -> bool:
    """Whether the lock on ``fd``'s file is free (taken and given back at once if so)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def test_a_path_is_required():
    with pytest.raises(ValueError, match="core_turns"):
        CoreTurns("")


def test_steps_of_two_engines_never_overlap_and_alternate(tmp_path):
    """Two holders (threads here: each its own descriptors, as two processes) stepping back to
    back: no two steps overlap, and neither takes two turns while the other waits."""
    path = str(tmp_path / "cores.lock")
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def engine(name: str) -> None:
        turns = CoreTurns(path)
        try:
            for _ in range(12):
                with turns.step():
                    t0 = time.perf_counter()
                    time.sleep(0.01)
                    with lock:
                        spans.append((name, t0, time.perf_counter()))
        finally:
            turns.close()

    threads = [threading.Thread(target=engine, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    spans.sort(key=lambda s: s[1])
    assert len(spans) == 24
    for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
        assert start >= end, "two engines stepped at once"
    # NOTE: once both are stepping, runs of one engine are at most 2 long (the turnstile).
    names = "".join(n for n, _, _ in spans)
    first_b, first_a = names.find("b"), names.find("a")
    both = names[max(first_a, first_b) :].rstrip(names[-1])
    assert "aaa" not in both and "bbb" not in both, names


def test_an_engine_stepping_back_to_back_lets_a_waiting_one_in(tmp_path):
    """Without the turnstile one engine re-taking the lock at once would starve the other."""
    path = str(tmp_path / "cores.lock")
    stop = threading.Event()
    busy_steps = 0

    def busy() -> None:
        nonlocal busy_steps
        turns = CoreTurns(path)
        try:
            while not stop.is_set():
                with turns.step():
                    busy_steps += 1
                    time.sleep(0.1)
        finally:
            turns.close()

    t = threading.Thread(target=busy)
    t.start()
    try:
        time.sleep(0.25)  # the busy engine is stepping
        waits: list[float] = []
        other = CoreTurns(path, on_wait=waits.append)
        before = busy_steps
        with other.step():
            during = busy_steps - before
        other.close()
        # at most the step in progress and one more (2 x 0.1 s), not the whole run
        assert during <= 2, during
        assert len(waits) == 1 and 0 < waits[0] < 1.0, waits
    finally:
        stop.set()
        t.join(10)


def test_another_process_holds_the_turn_until_it_ends_or_dies(tmp_path):
    path = str(tmp_path / "cores.lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pdd.serving.core_turns import CoreTurns\n"
            f"t = CoreTurns({path!r})\n"
            "with t.step():\n"
            "    print('holding', flush=True)\n"
            "    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        turns = CoreTurns(path)
        got = threading.Event()

        def take() -> None:
            with turns.step():
                got.set()

        t = threading.Thread(target=take)
        t.start()
        assert not got.wait(0.5), "took a turn another process holds"
        holder.kill()  # NOTE: a holder that dies frees its turn with its descriptors
        assert got.wait(10)
        t.join(10)
        turns.close()
        turns.close()  # twice is harmless
    finally:
        holder.kill()
        holder.wait()


async def test_an_engine_loop_steps_only_in_its_turn(tmp_path):
    path = str(tmp_path / "cores.lock")
    other = CoreTurns(path)
    engine = SlowEngine(0.005)
    runner = EngineLoop(engine, turns=CoreTurns(path))
    await runner.start()
    try:
        q = runner.open("a")
        with other.step():  # another engine of the host is stepping
            await runner.call(engine.add, "a", 3)
            await asyncio.sleep(0.5)
            assert engine.batches == [], "stepped while another engine held the turn"
        await asyncio.wait_for(_drain(q), 10)
        assert len(engine.batches) == 3
    finally:
        await runner.stop()
        runner.turns.close()
        other.close()


def test_a_peer_stopped_mid_step_delays_a_turn_once_then_steps_go_on_without(tmp_path):
    """Every wait has a deadline: a holder that never lets go (SIGSTOP, a hang) costs the other
    engines ``max_wait_s`` once; later steps go on without waiting until the lock comes free."""
    path = str(tmp_path / "cores.lock")
    stuck = CoreTurns(path)
    turns = CoreTurns(path, max_wait_s=0.3)
    try:
        with stuck.step():
            t0 = time.monotonic()
            with turns.step():
                pass
            first = time.monotonic() - t0
            assert 0.25 <= first < 5, first
            assert turns.bypassing
            t0 = time.monotonic()
            with turns.step():
                pass
            assert time.monotonic() - t0 < 0.25  # no wait while the lock is held elsewhere
        # the holder let go: the abandoned wait takes the lock and gives it back at once ...
        deadline = time.monotonic() + 5
        while turns.bypassing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not turns.bypassing
        # ... and the next step holds the turn again, and gives it back after
        other = os.open(path, os.O_RDWR)
        try:
            with turns.step():
                assert not _free(other), "stepped without the turn"
            assert _free(other)
        finally:
            os.close(other)
    finally:
        for t in (stuck, turns):
            t.close()


def test_max_wait_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_wait_s"):
        CoreTurns(str(tmp_path / "x.lock"), max_wait_s=0)
