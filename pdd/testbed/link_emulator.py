"""A userspace WAN emulator: an asyncio TCP proxy that shapes everything through it.

This kernel has no ``netem``, so the testbed puts this proxy between the
clusters: ``LinkEmulator(config, upstream="host:port")`` listens on a local
port and forwards each accepted connection to ``upstream``. gRPC (HTTP/2) is
just a TCP byte stream to it.

Life of a byte: read from one socket → queued in that connection's ``Flow`` →
admitted by the direction's shared scheduler (bandwidth, fair round-robin,
stall windows; ``link_shaper``) → held for the one-way delay (+ jitter) →
written to the other socket, in order. Both directions are shaped
independently with the same config (a symmetric, full-duplex link).

Faults: ``stall_every_s``/``stall_ms`` open periodic windows in which nothing
is admitted (what TCP makes of a loss burst: a stall); ``reset_connections()``
drops every connection at once (RST to both ends) to test resumption.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pdd.testbed.link_shaper import Flow, LinkDirection

log = structlog.get_logger(__name__)
_READ = 64 << 10


@dataclass(frozen=True)
class LinkConfig:
    # Bandwidth of each direction in megabits/s; 0 = unlimited.
    mbps: float = 0.0
    # One-way delay of each direction.
    delay_ms: float = 0.0
    # Random extra delay per quantum, uniform in [0, jitter_ms]; never reorders.
    jitter_ms: float = 0.0
    # Every stall_every_s seconds, nothing is admitted for stall_ms.
    stall_every_s: float = 0.0
    stall_ms: float = 0.0
    seed: int = 0
    # Scheduling unit; 0 = about 1 ms of link time (1500 B .. 64 KiB).
    quantum_bytes: int = 0
    # Idle credit: bytes that may leave back-to-back after a pause; 0 = 4 quanta.
    # NOTE: it also absorbs timer lateness; with less than ~1 ms of it the link
    # loses time whenever the event loop wakes late and falls below its rate.
    burst_bytes: int = 0
    # Bytes a flow may queue before its reader pauses.
    max_pending_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        for name in ("mbps", "delay_ms", "jitter_ms", "stall_every_s", "stall_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{name}: must be a number >= 0, got {value!r}")
        if self.stall_ms and not self.stall_every_s:
            raise ValueError("stall_every_s: must be set when stall_ms is")
        if self.stall_every_s and self.stall_ms >= self.stall_every_s * 1000:
            raise ValueError(f"stall_ms: must be shorter than the period ({self.stall_every_s} s)")
        if self.quantum_bytes < 0:
            raise ValueError(f"quantum_bytes: must be >= 0, got {self.quantum_bytes}")
        if self.burst_bytes < 0:
            raise ValueError(f"burst_bytes: must be >= 0, got {self.burst_bytes}")
        if self.max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes: must be positive, got {self.max_pending_bytes}")

    @property
    def bytes_per_s(self) -> float:
        return self.mbps * 1e6 / 8

    @property
    def quantum(self) -> int:
        if self.quantum_bytes:
            return self.quantum_bytes
        if not self.mbps:
            return _READ
        return int(min(max(self.bytes_per_s * 1e-3, 1500), 64 << 10))


@dataclass(frozen=True)
class LinkStats:
    bytes_up: int  # client → upstream
    bytes_down: int  # upstream → client
    connections_total: int
    connections_active: int
    # Delivered bytes over the time between the first and last delivery, per
    # direction, since start or reset_counters().
    up_mbps: float
    down_mbps: float


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.first = self.last = 0.0

    def add(self, n: int) -> None:
        now = time.monotonic()
        if not self.bytes:
            self.first = now
        self.bytes += n
        self.last = now

    @property
    def mbps(self) -> float:
        span = self.last - self.first
        return self.bytes * 8 / span / 1e6 if span > 0 else 0.0


class _Connection:
    def __init__(
        self,
        emulator: LinkEmulator,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.em = emulator
        self.client, self.upstream = client, upstream
        cfg = emulator.config
        self.up = Flow(emulator.up, max(cfg.max_pending_bytes, 4 * cfg.quantum))
        self.down = Flow(emulator.down, max(cfg.max_pending_bytes, 4 * cfg.quantum))
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        em = self.em
        em.up.add(self.up)
        em.down.add(self.down)
        self.tasks = [
            asyncio.create_task(c)
            for c in (
                self._pump(self.client[0], self.up),
                self._pump(self.upstream[0], self.down),
                self._deliver(self.up, self.upstream[1], lambda: em.counter_up),
                self._deliver(self.down, self.client[1], lambda: em.counter_down),
            )
        ]
        try:
            await asyncio.gather(*self.tasks)
        except (ConnectionError, OSError):
            self.abort()
        except asyncio.CancelledError:
            self.abort()
            raise
        finally:
            for t in self.tasks:
                t.cancel()
            em.up.remove(self.up)
            em.down.remove(self.down)
            for _, writer in (self.client, self.upstream):
                writer.close()

    def abort(self) -> None:
        for _, writer in (self.client, self.upstream):
            writer.transport.abort()
        for t in self.tasks:
            t.cancel()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, flow: Flow) -> None:
        while data := await reader.read(_READ):
            await flow.put(data)
        flow.put_eof()

    @staticmethod
    async def _deliver(
        flow: Flow, writer: asyncio.StreamWriter, counter: Callable[[], _Counter]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not flow.in_flight:
                flow.arrived.clear()
                await flow.arrived.wait()
            at, data = flow.in_flight[0]
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            flow.in_flight.popleft()
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            counter().add(len(data))
            await writer.drain()


class LinkEmulator:
    def __init__(
        self, config: LinkConfig, upstream: str, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        up_host, sep, up_port = upstream.rpartition(":")
        if not sep or not up_port.isdigit():
            raise ValueError(f"upstream: expected host:port, got {upstream!r}")
        self.config = config
        self._upstream = (up_host, int(up_port))
        self._listen = (host, port)
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections_total = 0
        self.counter_up, self.counter_down = _Counter(), _Counter()
        cfg, rng = config, random.Random(config.seed)
        self.up, self.down = (
            LinkDirection(
                bytes_per_s=cfg.bytes_per_s,
                delay_s=cfg.delay_ms / 1e3,
                jitter_s=cfg.jitter_ms / 1e3,
                stall_every_s=cfg.stall_every_s,
                stall_s=cfg.stall_ms / 1e3,
                quantum=cfg.quantum,
                burst_bytes=cfg.burst_bytes or 4 * cfg.quantum,
                rng=random.Random(rng.random()),
            )
            for _ in range(2)
        )
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._listen[0]}:{self.port}"

    async def start(self) -> str:
        """Start listening; returns ``host:port`` to connect to instead of the upstream."""
        for direction in (self.up, self.down):
            self._spawn(direction.run())
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info(
            "link_emulator_started",
            listen=self.address,
            upstream=f"{self._upstream[0]}:{self._upstream[1]}",
            mbps=self.config.mbps,
            delay_ms=self.config.delay_ms,
            jitter_ms=self.config.jitter_ms,
        )
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset_connections()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def reset_connections(self) -> int:
        """Drop every open connection (both ends see a reset); returns how many."""
        dropped = list(self._connections)
        for conn in dropped:
            conn.abort()
        return len(dropped)

    def reset_counters(self) -> None:
        """Start a new measurement window for ``stats()``'s bytes and throughput."""
        self.counter_up, self.counter_down = _Counter(), _Counter()

    def stats(self) -> LinkStats:
        return LinkStats(
            self.counter_up.bytes,
            self.counter_down.bytes,
            self.connections_total,
            len(self._connections),
            self.counter_up.mbps,
            self.counter_down.mbps,
        )

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_total += 1
        try:
            upstream = await asyncio.open_connection(*self._upstream)
        except OSError as e:
            log.warning("link_emulator_upstream_unreachable", error=str(e))
            writer.transport.abort()
            return
        for w in (writer, upstream[1]):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(self, (reader, writer), upstream)
        self._connections.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(conn)
