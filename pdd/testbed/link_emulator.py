"""A userspace WAN emulator: an asyncio TCP proxy that shapes everything through it.

This kernel has no ``netem``, so the testbed puts this proxy between the
clusters: ``LinkEmulator(config, upstream="host:port")`` listens on a local
port and forwards each accepted connection to ``upstream``. gRPC (HTTP/2) is
just a TCP byte stream to it.

Life of a byte: read from one socket → queued in that connection's ``Flow`` →
admitted by the direction's shared scheduler (bandwidth, fair round-robin,
stall windows; ``link_shaper``) → held for the one-way delay (+ jitter) →
written to the other socket, in order. Both directions are shaped
independently with the same config (a symmetric, full-duplex link). A link
with nothing to shape (``LinkConfig.shaped`` false) forwards in the kernel
instead (``link_splice``), counted the same way.

Many routes, one link: ``LinkEmulator(config, routes=[Route(listen, upstream), ...])`` listens on
each route's address and forwards it to that route's upstream, every connection of every route
through the same two ``LinkDirection`` s — one bandwidth bucket and one delay, as one WAN link to a
remote cluster carries all of its MainDecodes. ``stats()`` counts the whole link,
``route_stats()`` each route.

Faults: ``stall_every_s``/``stall_ms`` open periodic windows in which nothing
is admitted (what TCP makes of a loss burst: a stall); ``reset_connections()``
drops every connection at once (RST to both ends) to test resumption.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from pdd.testbed import link_splice
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
    def shaped(self) -> bool:
        """Whether there is anything to emulate; an unshaped link forwards in the kernel."""
        return bool(self.mbps or self.delay_ms or self.jitter_ms or self.stall_every_s)

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


@dataclass(frozen=True)
class Route:
    """One listen address forwarded to one upstream, over the emulator's shared link."""

    # host:port to listen on; port 0 picks a free one (``LinkEmulator.addresses`` tells which).
    listen: str
    # host:port every accepted connection is forwarded to.
    upstream: str

    def __post_init__(self) -> None:
        for name in ("listen", "upstream"):
            _host_port(name, getattr(self, name))

    @classmethod
    def parse(cls, text: str) -> Route:
        """``LISTEN=UPSTREAM`` (both host:port), as ``--route`` takes it."""
        listen, sep, upstream = text.partition("=")
        if not sep:
            raise ValueError(f"route: expected LISTEN=UPSTREAM (host:port each), got {text!r}")
        return cls(listen.strip(), upstream.strip())


def _host_port(name: str, text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{name}: expected host:port, got {text!r}")
    return host, int(port)


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
        route: _RouteState,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.em = emulator
        self.route = route
        self.client, self.upstream = client, upstream
        cfg = emulator.config
        self.up = Flow(emulator.up, max(cfg.max_pending_bytes, 4 * cfg.quantum))
        self.down = Flow(emulator.down, max(cfg.max_pending_bytes, 4 * cfg.quantum))
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        em, route = self.em, self.route
        em.up.add(self.up)
        em.down.add(self.down)
        self.tasks = [
            asyncio.create_task(c)
            for c in (
                self._pump(self.client[0], self.up),
                self._pump(self.upstream[0], self.down),
                self._deliver(self.up, self.upstream[1], lambda: (em.counter_up, route.up)),
                self._deliver(self.down, self.client[1], lambda: (em.counter_down, route.down)),
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
        flow: Flow, writer: asyncio.StreamWriter, counters: Callable[[], tuple[_Counter, ...]]
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
            for counter in counters():
                counter.add(len(data))
            await writer.drain()


class _RouteState:
    """A route's listening socket and its own counters (the link's are the emulator's)."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.listen = _host_port("listen", route.listen)
        self.upstream = _host_port("upstream", route.upstream)
        self.server: asyncio.Server | None = None
        # An unshaped link's listening socket (``link_splice``) instead of ``server``.
        self.lsock: socket.socket | None = None
        self.port = 0
        self.connections_total = 0
        self.connections: set[_Connection | link_splice.SplicedConnection] = set()
        self.up, self.down = _Counter(), _Counter()

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.port or self.listen[1]}"

    def stats(self) -> LinkStats:
        return LinkStats(
            self.up.bytes,
            self.down.bytes,
            self.connections_total,
            len(self.connections),
            self.up.mbps,
            self.down.mbps,
        )


class LinkEmulator:
    """One emulated link: ``upstream`` (listening on ``host:port``) and/or ``routes``.

    NOTE: every route shares the link's two directions (bandwidth, delay, jitter, stalls): two
    routes sending at once each get about half of ``mbps``, as two connections of one route do.
    """

    def __init__(
        self,
        config: LinkConfig,
        upstream: str = "",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        routes: Sequence[Route] = (),
    ) -> None:
        all_routes = [Route(f"{host}:{port}", upstream)] if upstream else []
        all_routes += routes
        if not all_routes:
            raise ValueError("upstream: expected host:port (or at least one route)")
        self.config = config
        self._routes = [_RouteState(r) for r in all_routes]
        self._connections: set[_Connection | link_splice.SplicedConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
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

    @property
    def connections_total(self) -> int:
        return sum(r.connections_total for r in self._routes)

    @property
    def port(self) -> int:
        """The first route's bound port (0 before ``start()``)."""
        return self._routes[0].port

    @property
    def address(self) -> str:
        """host:port of the first route (the only one of the single-upstream form)."""
        return self._routes[0].address

    @property
    def addresses(self) -> list[str]:
        """host:port to connect to instead of each route's upstream, in the routes' order."""
        return [r.address for r in self._routes]

    @property
    def routes(self) -> list[Route]:
        return [r.route for r in self._routes]

    async def start(self) -> str:
        """Start listening on every route; returns the first one's ``host:port``."""
        shaped = self.config.shaped
        if shaped:
            for direction in (self.up, self.down):
                self._spawn(direction.run())
        try:
            for r in self._routes:
                if not shaped:
                    r.lsock = link_splice.listen(*r.listen)
                    r.port = r.lsock.getsockname()[1]
                    self._spawn(link_splice.serve(r.lsock, lambda c, r=r: self._splice(r, c)))
                    continue
                r.server = await asyncio.start_server(
                    lambda reader, writer, r=r: self._accept(r, reader, writer), *r.listen
                )
                r.port = r.server.sockets[0].getsockname()[1]
        except BaseException:
            await self.stop()
            raise
        log.info(
            "link_emulator_started",
            routes=[f"{r.address}={r.route.upstream}" for r in self._routes],
            mbps=self.config.mbps,
            delay_ms=self.config.delay_ms,
            jitter_ms=self.config.jitter_ms,
            forwarding="shaped" if shaped else "splice",
        )
        return self.address

    async def stop(self) -> None:
        for r in self._routes:
            if r.server is not None:
                r.server.close()
        self.reset_connections()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self._routes:
            if r.server is not None:
                await r.server.wait_closed()
                r.server = None
            if r.lsock is not None:
                r.lsock.close()
                r.lsock = None

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
        for r in self._routes:
            r.up, r.down = _Counter(), _Counter()

    def stats(self) -> LinkStats:
        """The whole link: every route together."""
        return LinkStats(
            self.counter_up.bytes,
            self.counter_down.bytes,
            self.connections_total,
            len(self._connections),
            self.counter_up.mbps,
            self.counter_down.mbps,
        )

    def route_stats(self) -> dict[str, LinkStats]:
        """Each route's own share of ``stats()``, by its upstream (host:port)."""
        return {r.route.upstream: r.stats() for r in self._routes}

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(
        self, route: _RouteState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A shaped link's connection: its bytes through the link's two ``LinkDirection`` s."""
        route.connections_total += 1
        try:
            upstream = await asyncio.open_connection(*route.upstream)
        except OSError as e:
            _unreachable(route, e)
            writer.transport.abort()
            return
        for w in (writer, upstream[1]):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await self._hold(route, _Connection(self, route, (reader, writer), upstream))

    async def _splice(self, route: _RouteState, client: socket.socket) -> None:
        """An unshaped link's connection: forwarded by ``splice(2)`` (``link_splice``)."""
        route.connections_total += 1
        try:
            upstream = await link_splice.connect(*route.upstream)
        except OSError as e:
            _unreachable(route, e)
            client.close()
            return
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = link_splice.SplicedConnection(
            client,
            upstream,
            lambda n: (self.counter_up.add(n), route.up.add(n)),
            lambda n: (self.counter_down.add(n), route.down.add(n)),
        )
        await self._hold(route, conn)

    async def _hold(
        self, route: _RouteState, conn: _Connection | link_splice.SplicedConnection
    ) -> None:
        """Run ``conn`` to its end, known meanwhile to ``reset_connections`` and the counts."""
        self._connections.add(conn)
        route.connections.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass  # NOTE: a connection cancelled has aborted itself
        finally:
            self._connections.discard(conn)
            route.connections.discard(conn)


def _unreachable(route: _RouteState, error: OSError) -> None:
    log.warning(
        "link_emulator_upstream_unreachable", upstream=route.route.upstream, error=str(error)
    )
