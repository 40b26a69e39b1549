"""``tc tbf`` in a network namespace shapes loopback traffic (only where root and ``ip netns`` work)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdd.testbed.netns_link import TbfConfig, TbfNamespace, tbf_available

# Sends 3 MB over the namespace's loopback; prints the receiver's first→last byte rate in Mbit/s.
_PROBE = r"""
import socket, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
out = {}
def sink():
    conn, _ = srv.accept(); n = 0; first = None
    while data := conn.recv(1 << 16):
        first = first or time.monotonic(); n += len(data)
    out["mbps"] = n * 8 / (time.monotonic() - first) / 1e6
t = threading.Thread(target=sink); t.start()
c = socket.create_connection(srv.getsockname()); c.sendall(bytes(3 << 20)); c.close(); t.join()
print(out["mbps"])
"""


@pytest.mark.skipif(not tbf_available(), reason="needs root and a working `ip netns`")
def test_tbf_namespace_shapes_loopback_and_is_removed():
    with TbfNamespace(TbfConfig(mbps=50)) as ns:
        done = subprocess.run(
            ns.command([sys.executable, "-I", "-c", _PROBE]),
            capture_output=True,
            text=True,
            timeout=15,
        )
        assert done.returncode == 0, done.stderr
        name = ns.name
    assert 37.5 <= float(done.stdout) <= 62.5
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


def test_tbf_config_validation_names_the_field():
    with pytest.raises(ValueError, match="^mbps"):
        TbfConfig(mbps=0)
    with pytest.raises(ValueError, match="^burst_kib"):
        TbfConfig(mbps=1, burst_kib=0)
