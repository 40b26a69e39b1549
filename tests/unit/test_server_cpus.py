"""CPU lists and placement (``pdd.server.cpus``), and the configs that take them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdd.core.instance import InstanceRef, Role
from pdd.engine.config import EngineConfig
from pdd.server import cpus
from pdd.server.config import ServerConfig
from pdd.serving.engine_instance import EngineInstance, InstanceConfig
from pdd.testbed.placement import Placement

TWO = pytest.mark.skipif(len(cpus.allowed()) < 2, reason="needs two CPUs this process may use")


@pytest.mark.parametrize(
    "text,want",
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7", {0, 1, 4, 6, 7}), (" 2 , 1 ", {1, 2})],
)
def test_parse_and_format_round_trip(text, want):
    got = cpus.parse_cpus(text)
    assert got == want
    assert cpus.parse_cpus(cpus.format_cpus(got)) == got


def test_format_joins_runs():
    assert cpus.format_cpus({8, 0, 1, 2, 3, 5}) == "0-3,5,8"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1-", "0,,1", "1.5"])
def test_parse_refuses_what_is_not_a_list(text):
    with pytest.raises(ValueError, match="CPU list"):
        cpus.parse_cpus(text)


def test_check_names_the_field_and_the_cpus_outside():
    beyond = max(cpus.allowed()) + 1
    with pytest.raises(ValueError, match=rf"engine_cpus: CPU {beyond} not among"):
        cpus.check("engine_cpus", frozenset({beyond}))
    with pytest.raises(ValueError, match="cpus: no CPU named"):
        cpus.check("cpus", frozenset())
    cpus.check("cpus", None)
    cpus.check("cpus", cpus.allowed())


def test_split_keeps_the_last_for_the_frontends():
    assert cpus.split([3, 0, 1, 2], 1) == ({0, 1, 2}, {3})
    assert cpus.split(range(4), 2) == ({0, 1}, {2, 3})
    for n in (0, 4):
        with pytest.raises(ValueError, match=r"frontend_cpus: must be 1\.\.3 on 4 CPUs"):
            cpus.split(range(4), n)


def test_configs_refuse_cpus_they_cannot_have():
    beyond = frozenset({max(cpus.allowed()) + 1})
    with pytest.raises(ValueError, match="^cpus: CPU"):
        ServerConfig(cpus=beyond)
    ref = InstanceRef("md-0", "127.0.0.1:0", Role.MAIN_DECODE)
    with pytest.raises(ValueError, match="^engine_cpus: CPU"):
        InstanceConfig(ref, "k:1", "tiny:1", EngineConfig(), engine_cpus=beyond)
    one = frozenset({min(cpus.allowed())})
    with pytest.raises(ValueError, match=r"^threads: must be <= the 1 CPUs of engine_cpus"):
        InstanceConfig(ref, "k:1", "tiny:1", EngineConfig(), threads=2, engine_cpus=one)
    cfg = InstanceConfig(ref, "k:1", "tiny:1", EngineConfig(), engine_cpus=one)
    assert EngineInstance(cfg).threads == 1  # NOTE: none configured: one per engine CPU
    assert EngineInstance(InstanceConfig(ref, "k:1", "tiny:1", EngineConfig())).threads == 0


@TWO
def test_placement_flags_per_module():
    p = Placement(frozenset({0}), frozenset({1}))
    assert p.flags("services.gateway") == ["--cpus", "1"]
    assert p.flags("services.main_decode") == ["--cpus", "1", "--engine-cpus", "0"]
    assert p.flags("services.wan_link") == []
    assert Placement.keeping(0) is None


@TWO
def test_openmp_team_inherits_the_engine_threads_cpus():
    """What ``EngineInstance`` relies on: the engine thread places itself, then its first
    parallel step starts the OpenMP team; every thread of that team runs where it does."""
    code = """
import os, threading, torch
from pdd.server import cpus
main = set(os.sched_getaffinity(0))
before = set(os.listdir("/proc/self/task"))
def engine():
    cpus.place(frozenset({1}))
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(5):
        a @ a
    team = set(os.listdir("/proc/self/task")) - before - {str(threading.get_native_id())}
    assert team, "no OpenMP thread started"
    print(sorted(os.sched_getaffinity(int(t)) == {1} for t in team), os.sched_getaffinity(0))
t = threading.Thread(target=engine)
t.start()
t.join()
print(os.sched_getaffinity(0) == main)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr
    team, main_kept = out.stdout.strip().splitlines()
    assert "False" not in team and "True" in team, team
    assert main_kept == "True"
