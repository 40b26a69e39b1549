"""The one gRPC server bootstrap every service runs.

Life of a server: ``run`` tells malloc to keep freed transfer buffers for the next one (``heap``) →
build an asyncio ``grpc.aio`` server with the context interceptor → the service registers its
servicers → ``grpc.health.v1`` and reflection are added → the domain's ``start()`` runs (connect
Redis, load the model, ...) → the server starts (TLS as ``config.tls`` says) → ``serving(port)``
runs (register with kvstore) → health turns SERVING and one line ``PDD_LISTENING <service>
<host:port>`` is printed on stdout (launchers parse it when port 0 was asked), after what is alive
was frozen out of garbage collection (``gc_pauses``) → SIGTERM/SIGINT: health turns NOT_SERVING,
``draining()`` runs, in-flight calls get ``grace_s`` to finish, the domain's ``stop()`` runs, the
process exits 0.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdd.server import cpus, heap, tls
from pdd.server.authorization import AuthorizationInterceptor
from pdd.server.config import ServerConfig
from pdd.server.interceptors import ContextInterceptor
from pdd.server.telemetry_interceptor import TelemetryInterceptor
from pdd.telemetry import gc_pauses, metrics
from pdd.telemetry.metrics import start_metrics_server

log = structlog.get_logger(__name__)

Hook = Callable[[], Awaitable[None]]


async def _noop() -> None:
    return None


@dataclass
class ServiceSpec:
    """What one deployable service plugs into the bootstrap."""

    # Short name for logs, e.g. "kvstore".
    name: str
    # Fully qualified gRPC service names, e.g. "pdd.kvstore.v1.KvstoreService".
    grpc_services: Sequence[str]
    register: Callable[[grpc.aio.Server], None]
    start: Hook = field(default=_noop)
    stop: Hook = field(default=_noop)
    # Runs once the server accepts calls, with the bound port (e.g. register with kvstore).
    serving: Callable[[int], Awaitable[None]] | None = None
    # Runs on SIGTERM before in-flight calls get their grace: end what would otherwise hold
    # the server open for all of it (MainDecode's shared decode streams).
    draining: Hook = field(default=_noop)


class GrpcServer:
    """A started server; ``port`` is the bound one."""

    def __init__(self, config: ServerConfig, spec: ServiceSpec) -> None:
        self.config = config
        self.spec = spec
        self.tls = config.tls
        self._health_server: grpc.aio.Server | None = None
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # NOTE: peers ping every 20 s (``pdd.serving.channels``) and keep long-lived streams
            # that can be quiet for minutes (MainDecode's shared decode stream between bursts);
            # gRPC's default answers the third ping without data with GOAWAY, which would break
            # every call on the connection.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
        # NOTE: telemetry outermost: it sees the status code ContextInterceptor maps errors to;
        # authorization innermost, inside the call's log context.
        interceptors = [TelemetryInterceptor(), ContextInterceptor()]
        if config.tls.authorize:
            interceptors.append(AuthorizationInterceptor())
        self._server = grpc.aio.server(interceptors=interceptors, options=options)
        self._health = health.aio.HealthServicer()
        self.port = 0

    async def start(self) -> int:
        spec = self.spec
        spec.register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [
            *spec.grpc_services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self._server)
        self.port = tls.add_port(self._server, self.config.address, self.tls)
        if self.port == 0:
            raise OSError(f"could not bind {self.config.address}")
        await spec.start()
        await self._server.start()
        if self.tls.health_port:
            await self._start_health_listener()
        if spec.serving is not None:
            await spec.serving(self.port)
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "server_started",
            address=f"{self.config.host}:{self.port}",
            tls=self.tls.enabled,
            mutual_tls=self.tls.require_client_cert,
            authorized_roles=self.tls.authorize,
        )
        return self.port

    async def _start_health_listener(self) -> None:
        # Plaintext and health-only: what kubelet's native gRPC probes can reach when TLS is on.
        self._health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        address = f"{self.config.host}:{self.tls.health_port}"
        if self._health_server.add_insecure_port(address) == 0:
            raise OSError(f"could not bind the health port {address}")
        await self._health_server.start()

    async def stop(self) -> None:
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.spec.draining()
        await self._server.stop(self.config.grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        await self.spec.stop()
        log.info("server_stopped")

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    async def _set_status(self, status: int) -> None:
        # NOTE: "" is the whole-server status that `grpc_health_probe` asks for.
        for name in ("", *self.spec.grpc_services):
            await self._health.set(name, status)


async def serve(config: ServerConfig, spec: ServiceSpec) -> None:
    """Run ``spec`` until SIGTERM or SIGINT, then shut down gracefully."""
    server = GrpcServer(config, spec)
    await server.start()
    # NOTE: a process-wide choice, so here and not in GrpcServer (tests run servers in-process): once
    # the service started (imports done, model loaded), a collection scans only what requests allocate,
    # not the ~350K start-up objects (gc_pauses).
    log.info("gc_startup_frozen", objects=gc_pauses.freeze_startup_objects())
    gc_pauses.watch()
    loop = asyncio.get_running_loop()
    # NOTE: read at scrape time from the metrics thread; all_tasks copes with a changing set.
    metrics.ASYNCIO_TASKS.set_function(lambda: len(asyncio.all_tasks(loop)))
    if config.metrics_port:
        _, port = start_metrics_server(config.host, config.metrics_port, config.tls)
        log.info("metrics_started", address=f"{config.host}:{port}", tls=bool(config.tls.cert))
    print(f"PDD_LISTENING {spec.name} {config.host}:{server.port}", flush=True)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # NOTE: `kill -USR2 <pid>` prints every unfinished asyncio task and where it waits (stderr).
    loop.add_signal_handler(signal.SIGUSR2, _dump_tasks, loop)
    await stopping.wait()
    log.info("shutdown_requested")
    await server.stop()


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"--- {len(tasks)} asyncio tasks ---", file=sys.stderr)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        frames = task.get_stack(limit=3)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
        print(f"{task.get_name()} {task.get_coro()!r:.120} at {where}", file=sys.stderr)
    sys.stderr.flush()


def run(config: ServerConfig, spec: ServiceSpec) -> None:
    """Blocking entry point for ``services/<name>/__main__.py``."""
    # NOTE: `kill -USR1 <pid>` dumps every thread's stack to stderr (diagnosing a stuck service).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    heap.tune()
    # NOTE: before the server's threads start: each inherits the set.
    cpus.place_process(config.cpus)
    try:
        asyncio.run(serve(config, spec))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 — a failed start exits non-zero with the reason
        log.error("server_failed", error=f"{type(exc).__name__}: {exc}")
        sys.exit(1)
