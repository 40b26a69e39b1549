"""One emulated link carrying several routes (a remote cluster's MainDecodes), on loopback.

Two routes through one 10 Mbit/s link share its 10 Mbit/s (not 10 each); the ``services.wan_link``
process takes repeated ``--route`` and counts each route's bytes on ``/metrics``. Margins are
wide (two busy cores): each test moves about 2 MiB.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import pytest

from pdd.testbed.launcher import free_port, start_module
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator, Route
from services.wan_link.config import WanLinkConfig

MIB = 1 << 20


class Sink:
    """A TCP server that reads until EOF, remembers how much, and answers b"ok"."""

    def __init__(self) -> None:
        self.received = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            self.received += len(data)
        writer.write(b"ok")
        await writer.drain()
        writer.close()


@pytest.fixture
async def sinks():
    out, servers = [], []
    for _ in range(2):
        s = Sink()
        server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        servers.append(server)
        out.append((s, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"))
    yield out
    for server in servers:
        server.close()


async def _send(address: str, payload: bytes) -> float:
    """Send, half-close, wait for the answer; returns when it came (monotonic)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    assert await reader.read() == b"ok"
    writer.close()
    return time.monotonic()


async def test_two_routes_share_one_links_bandwidth(sinks):
    (a, up_a), (b, up_b) = sinks
    routes = [Route("127.0.0.1:0", up_a), Route("127.0.0.1:0", up_b)]
    async with LinkEmulator(LinkConfig(mbps=10), routes=routes) as em:
        first, second = em.addresses
        assert first != second
        start = time.monotonic()
        done = await asyncio.gather(_send(first, bytes(MIB)), _send(second, os.urandom(MIB)))
        elapsed = max(done) - start
    assert a.received == b.received == MIB
    # 2 MiB at 10 Mbit/s is ~1.7 s on one shared link; two separate links would take ~0.84 s.
    together_mbps = 2 * MIB * 8 / elapsed / 1e6
    assert 6 <= together_mbps <= 13, together_mbps
    # Fair shares: neither route finished long before the other.
    assert abs(done[0] - done[1]) < 0.35 * elapsed, (done, elapsed)
    per_route = em.route_stats()
    assert per_route[up_a].bytes_up == per_route[up_b].bytes_up == MIB
    assert em.stats().bytes_up == 2 * MIB and em.stats().connections_total == 2


async def test_the_single_upstream_form_is_one_route(sinks):
    (a, up_a), _ = sinks
    async with LinkEmulator(LinkConfig(), up_a) as em:
        assert em.addresses == [em.address] and em.routes == [Route("127.0.0.1:0", up_a)]
        await _send(em.address, bytes(1000))
    assert a.received == 1000 and em.route_stats()[up_a].bytes_up == 1000


def _scrape(address: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdd_wan_link_bytes_total{"):
            labels, value = line.removeprefix("pdd_wan_link_bytes_total").rsplit(" ", 1)
            fields = dict(kv.split("=") for kv in labels.strip("{}").split(","))
            out[fields["route"].strip('"'), fields["direction"].strip('"')] = float(value)
    return out


async def test_the_service_forwards_repeated_routes_over_one_link(sinks, tmp_path):
    (a, up_a), (b, up_b) = sinks
    listen = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    metrics = f"127.0.0.1:{free_port()}"
    args = ["--mbps", "10", "--metrics-port", metrics.rpartition(":")[2]]
    args += ["--route", f"{listen[0]}={up_a}", "--route", f"{listen[1]}={up_b}"]
    link = await asyncio.to_thread(
        start_module, "wan-x", "services.wan_link", args, log_dir=tmp_path, timeout=60
    )
    try:
        assert link.address == listen[0]
        start = time.monotonic()
        done = await asyncio.gather(_send(listen[0], bytes(MIB)), _send(listen[1], bytes(MIB)))
        elapsed = max(done) - start
        counted = await asyncio.to_thread(_scrape, metrics)
    finally:
        link.stop(timeout=10)
    assert a.received == b.received == MIB
    assert 2 * MIB * 8 / elapsed / 1e6 <= 13, elapsed  # one link's 10 Mbit/s, not two
    assert counted[up_a, "up"] == counted[up_b, "up"] == MIB
    assert (tmp_path / "wan-x.log").read_text().count("PDD_ROUTE ") == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "upstream"),
        ({"routes": ("127.0.0.1:1",)}, "route"),
        ({"routes": ("127.0.0.1:1=nowhere",)}, "upstream"),
        ({"upstream": "127.0.0.1:1", "metrics_port": 70000}, "metrics_port"),
    ],
)
def test_wan_link_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        WanLinkConfig(**kwargs)
