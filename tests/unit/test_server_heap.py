"""``pdd.server.heap``: a tuned process reuses a freed transfer-sized buffer instead of faulting
a new one in; an operator's own malloc settings are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdd.server import heap

# Churn 3 MiB buffers as a KV push does (a chunk's bytes built, sent, freed) and count the
# page faults of the last 20 (3 MiB is 768 pages: faulting each one in again shows at once).
CHURN = """
import json, resource, sys
from pdd.server import heap
tuned = heap.tune() if sys.argv[1] == "tune" else False
keep = []
for i in range(40):
    if i == 20:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = bytes(bytearray(3 << 20))
    keep.append(len(buf))
    del buf
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _churn(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in heap.OPERATOR_ENV}
    done = subprocess.run(
        [sys.executable, "-c", CHURN, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_tuned_process_reuses_freed_transfer_buffers():
    untuned, tuned = _churn("as-is"), _churn("tune")
    assert tuned["tuned"] is True
    # 20 buffers of 768 pages: faulted in anew each time without, reused with.
    assert untuned["faults"] > 20 * 700, untuned
    assert tuned["faults"] < 20 * 50, tuned


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"PDD_MALLOC_TUNING": "0"}, "disabled_by_PDD_MALLOC_TUNING"),
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, "operator_set_MALLOC_TRIM_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "operator_set_GLIBC_TUNABLES"),
        ({"PDD_MALLOC_TUNING": "1"}, None),
        ({}, None),
    ],
)
def test_an_operators_own_settings_win(env, reason):
    assert heap.left_alone(env) == reason
    if reason is not None:
        assert heap.tune(env) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_switch_off_leaves_malloc_as_it_was():
    off = _churn("tune", PDD_MALLOC_TUNING="0")
    assert off["tuned"] is False and off["faults"] > 20 * 700, off


# Free 24 MiB of heap, then let protobuf's upb free 30,000 messages' arenas (it calls
# malloc_trim(0) every 10,000) and count the faults of allocating the 24 MiB again.
UPB_CHURN = """
import json, resource, sys
from pdd.server import heap
if sys.argv[1] == "no-guard":
    heap.keep_upb_from_trimming = lambda: "skipped"
tuned = heap.tune()
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
bufs = [bytearray(3 << 20) for _ in range(8)]
del bufs
for _ in range(30000):
    msg = mdpb.PushKvRequest()
    msg.chunk.request_id = "r"
    del msg
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bufs = [bytearray(3 << 20) for _ in range(8)]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
    reason="glibc's malloc, an ELF GOT",
)
def test_protobufs_own_malloc_trim_no_longer_hands_the_kept_heap_back():
    def run(mode: str) -> dict:
        clean = {k: v for k, v in os.environ.items() if k not in heap.OPERATOR_ENV}
        done = subprocess.run(
            [sys.executable, "-c", UPB_CHURN, mode],
            env=clean,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    unguarded, guarded = run("no-guard"), run("guard")
    assert unguarded["tuned"] and guarded["tuned"]
    assert unguarded["faults"] > 5000, unguarded  # 6,144 pages faulted in anew after the trim
    assert guarded["faults"] < 500, guarded


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
    reason="glibc's malloc, an ELF GOT",
)
def test_the_guard_says_what_it_did():
    assert heap.keep_upb_from_trimming() == "disarmed"  # again: the same slot, the same target
