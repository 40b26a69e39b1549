"""The WAN emulator on loopback: pass-through, bandwidth, delay, fairness, jitter, stalls, resets.

An unshaped link (``LinkConfig()``) forwards by ``splice(2)`` (``link_splice``), a shaped one
through Python; the pass-through and reset tests run on both.

Bounds are generous (two busy cores); each test moves at most a few MB.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from pdd.testbed.link_emulator import LinkConfig, LinkEmulator


class Sink:
    """A TCP server that echoes b"p" pings and otherwise counts what it reads."""

    def __init__(self) -> None:
        self.received: dict[int, bytes] = {}
        self.spans: dict[int, float] = {}
        self._n = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self._n = self._n, self._n + 1
        parts, first = [], None
        while data := await reader.read(1 << 16):
            if data == b"p":
                writer.write(b"p")
                await writer.drain()
                continue
            first = first or time.monotonic()
            parts.append(data)
        self.received[conn] = b"".join(parts)
        self.spans[conn] = time.monotonic() - first if first else 0.0
        writer.write(self.received[conn][: 1 << 20])  # echo (up to 1 MiB) back, then close
        await writer.drain()
        writer.close()


@pytest.fixture
async def sink():
    s = Sink()
    server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    yield s, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def _connect(address: str):
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _send(address: str, payload: bytes) -> tuple[bytes, float]:
    """Send, half-close, read the echo; returns (echo, seconds)."""
    reader, writer = await _connect(address)
    start = time.monotonic()
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    echo = await reader.read()
    writer.close()
    return echo, time.monotonic() - start


# NOTE: an unshaped link (spliced) and one shaped only by a bandwidth it never reaches (Python).
BOTH_PATHS = pytest.mark.parametrize(
    "config", [LinkConfig(), LinkConfig(mbps=1e6)], ids=["spliced", "shaped"]
)


@BOTH_PATHS
async def test_a_link_passes_bytes_through_both_ways(sink, config):
    s, upstream = sink
    payload = os.urandom(3 << 20)
    async with LinkEmulator(config, upstream) as em:
        echo, _ = await _send(em.address, payload)
        # NOTE: counted as they leave: the last bytes may land a moment after the reader's EOF
        await asyncio.sleep(0.05)
        stats, per_route = em.stats(), em.route_stats()[upstream]
    assert s.received[0] == payload and echo == payload[: 1 << 20]
    assert (stats.bytes_up, stats.bytes_down, stats.connections_total) == (3 << 20, 1 << 20, 1)
    assert (per_route.bytes_up, per_route.bytes_down) == (3 << 20, 1 << 20)
    assert stats.connections_active == 0


def test_only_a_link_with_something_to_emulate_is_shaped():
    assert not LinkConfig().shaped
    for kwargs in ({"mbps": 1}, {"delay_ms": 1}, {"jitter_ms": 1}, {"stall_every_s": 1}):
        assert LinkConfig(**kwargs).shaped, kwargs


async def test_an_unshaped_link_keeps_many_connections_apart(sink):
    s, upstream = sink
    payloads = [os.urandom(200_000 + i) for i in range(8)]
    async with LinkEmulator(LinkConfig(), upstream) as em:
        echoes = await asyncio.gather(*(_send(em.address, p) for p in payloads))
    assert sorted(s.received.values()) == sorted(payloads)
    assert [e for e, _ in echoes] == payloads  # each got its own bytes back


async def test_an_unshaped_link_to_a_closed_port_closes_the_client():
    async with LinkEmulator(LinkConfig(), f"127.0.0.1:{_closed_port()}") as em:
        reader, writer = await _connect(em.address)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert em.stats().connections_total == 1


async def test_stop_drops_what_an_unshaped_link_holds(sink):
    _, upstream = sink
    em = LinkEmulator(LinkConfig(), upstream)
    await em.start()
    reader, writer = await _connect(em.address)
    writer.write(b"p")
    await writer.drain()
    assert await reader.readexactly(1) == b"p"
    await em.stop()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)
    writer.close()
    with pytest.raises(OSError):
        await _connect(em.address)  # NOTE: nothing listens there any more


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_bandwidth_is_shaped_to_the_configured_rate(sink):
    s, upstream = sink
    async with LinkEmulator(LinkConfig(mbps=40), upstream) as em:
        await _send(em.address, bytes(2 << 20))
    measured = (2 << 20) * 8 / s.spans[0] / 1e6
    assert 30 <= measured <= 50, measured
    assert 30 <= em.stats().up_mbps <= 50


async def test_round_trip_takes_at_least_twice_the_one_way_delay(sink):
    _, upstream = sink
    async with LinkEmulator(LinkConfig(delay_ms=20), upstream) as em:
        reader, writer = await _connect(em.address)
        rtts = []
        for _ in range(5):
            start = time.monotonic()
            writer.write(b"p")
            await writer.drain()
            assert await reader.readexactly(1) == b"p"
            rtts.append(time.monotonic() - start)
        writer.close()
    assert min(rtts) >= 0.040 and max(rtts) < 0.040 + 0.030, rtts


async def test_connections_share_the_link_fairly(sink):
    s, upstream = sink
    async with LinkEmulator(LinkConfig(mbps=40), upstream) as em:
        (_, t_a), (_, t_b) = await asyncio.gather(
            _send(em.address, bytes(1 << 20)), _send(em.address, os.urandom(1 << 20))
        )
    # Together they move 2 MiB at 40 Mbit/s (~0.42 s); neither finishes at the other's expense.
    assert 0.33 <= max(t_a, t_b) and abs(t_a - t_b) < 0.25 * max(t_a, t_b), (t_a, t_b)
    assert sorted(len(v) for v in s.received.values()) == [1 << 20, 1 << 20]


async def test_jitter_delays_but_never_reorders(sink):
    s, upstream = sink
    payload = os.urandom(1 << 20)
    async with LinkEmulator(LinkConfig(mbps=200, delay_ms=2, jitter_ms=8, seed=3), upstream) as em:
        echo, _ = await _send(em.address, payload)
    assert s.received[0] == payload and echo == payload


async def test_stall_windows_stop_the_link(sink):
    s, upstream = sink
    # Half of every 100 ms period is a stall: 1 MiB at 80 Mbit/s (~0.1 s) needs ~2x as long.
    async with LinkEmulator(LinkConfig(mbps=80, stall_every_s=0.1, stall_ms=50), upstream) as em:
        _, elapsed = await _send(em.address, bytes(1 << 20))
    assert s.received[0] == bytes(1 << 20)
    assert elapsed >= 0.16, elapsed


@pytest.mark.parametrize(
    "config", [LinkConfig(), LinkConfig(delay_ms=1)], ids=["spliced", "shaped"]
)
async def test_reset_drops_open_connections(sink, config):
    _, upstream = sink
    async with LinkEmulator(config, upstream) as em:
        reader, writer = await _connect(em.address)
        writer.write(b"p")
        await writer.drain()
        assert await reader.readexactly(1) == b"p"
        assert em.reset_connections() == 1
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)
        writer.close()
        await asyncio.sleep(0.05)
        assert em.stats().connections_active == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mbps": -1}, "mbps"),
        ({"delay_ms": float("nan")}, "delay_ms"),
        ({"stall_ms": 10}, "stall_every_s"),
        ({"stall_every_s": 0.01, "stall_ms": 10}, "stall_ms"),
        ({"quantum_bytes": -1}, "quantum_bytes"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        LinkConfig(**kwargs)
