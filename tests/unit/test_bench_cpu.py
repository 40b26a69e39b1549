"""CPU metering and cluster pinning, on real child processes (Linux /proc and sched_setaffinity)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdd.bench import pinning
from pdd.bench.cpu import CpuMeter, machine_cpu_s, process_cpu_s

linux = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
BUSY = "import time\nt = time.time()\nwhile time.time() - t < 5: pass\n"


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


@linux
def test_meter_tells_a_busy_process_from_an_idle_one(children):
    busy, idle = children(BUSY), children("import time; time.sleep(5)")
    time.sleep(0.3)  # let both get past interpreter start-up
    meter = CpuMeter(
        {"busy": busy.pid, "idle": idle.pid, "gone": 2**22 + 7}, {"busy": "main", "idle": "remote"}
    )
    meter.start()
    time.sleep(1.0)
    out = meter.stop()
    # A spinning process uses about one core; the machine may be shared, so only ask for a clear share.
    assert out["services"]["busy"] > 0.3 and out["services"]["idle"] < 0.05
    assert out["services"]["gone"] is None  # unreadable: missing, not zero
    assert out["clusters"] == {"main": out["services"]["busy"], "remote": out["services"]["idle"]}
    assert 0.0 < out["machine_busy"] <= 1.0 and out["others_cores"] >= 0.0
    assert out["total_cores_used"] == pytest.approx(
        out["services"]["busy"] + out["services"]["idle"], abs=1e-3
    )
    assert process_cpu_s(os.getpid()) > 0 and machine_cpu_s()[1] > machine_cpu_s()[0] > 0


def test_clusters_split_the_cpus():
    assert pinning.split_cpus([0]) is None
    assert pinning.split_cpus([1, 0]) == {"main": {0}, "remote": {1}}
    assert pinning.split_cpus(range(5)) == {"main": {0, 1, 2}, "remote": {3, 4}}
    assert [
        pinning.cluster_of(n)
        for n in ("main_decode-0", "wan-1", "prefill-0", "relay-0", "gateway", "bench_client")
    ] == ["remote", "remote", "main", "main", "main", "main"]


@linux
@pytest.mark.skipif(len(pinning.allowed_cpus()) < 2, reason="needs two CPUs")
def test_pinning_moves_every_thread_of_a_process(children):
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(5,)).start()\ntime.sleep(5)\n"
    a, b = children(code), children(code)
    time.sleep(0.3)
    split = pinning.split_cpus(pinning.allowed_cpus())
    placed = pinning.pin_processes({"main_decode-0": a.pid, "prefill-0": b.pid})
    assert placed == {"main_decode-0": "remote", "prefill-0": "main"}
    for pid, cluster in ((a.pid, "remote"), (b.pid, "main")):
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) >= 2
        assert all(os.sched_getaffinity(t) == split[cluster] for t in tids)
