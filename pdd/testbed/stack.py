"""The whole PDD stack on one machine, each service its own process.

Life of ``pdd up``: Redis (an embedded real server unless a URL is given) →
kvstore → main_decode instances, each behind a WAN link emulator (so every
byte to the "remote" cluster crosses the emulated link) → prefill and relay
instances → gateway (with the OpenAI-compatible HTTP API when ``http_port``
is set). Each prints where it listens; every service but the default shape's
WAN emulators serves Prometheus ``/metrics`` on its own port (``metrics``); ``stop()``
sends SIGTERM to all, in reverse order.

Many remote clusters (``StackConfig.clusters``): each ``ClusterSpec`` is one remote cluster of
``main_decodes`` MainDecodes (``main_decode-<cluster>-<i>``, registered with ``--cluster NAME``)
behind ONE emulated link, ``wan-<cluster>``: a single ``services.wan_link`` process with a route
per MainDecode, so they share the cluster's bandwidth and delay as they share prefill's stream
pool to it; it serves ``/metrics`` (bytes per route). Without clusters the stack has today's
shape: one cluster "remote" of ``main_decode`` instances (``main_decode-<i>``), each behind its
own ``wan-<i>`` with ``wan``'s settings.

With ``restart="on-failure"`` a
supervisor thread (``pdd.testbed.supervisor``) restarts a service that dies,
on the address it had, with backoff.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdd.core.errors import UnavailableError
from pdd.engine.model_source import resolve_model_source
from pdd.prefix_index.redis_server import RedisBinary, redis_binary, start_redis
from pdd.serving.model_spec import tiny_kwargs
from pdd.testbed.launcher import Process, free_port, pinned_args, spawn_module, start_module
from pdd.testbed.placement import UNFLAGGED_MODULES, Placement
from pdd.testbed.supervisor import Supervisor

RESTART_POLICIES = ("no", "on-failure")

MODEL_FORMS = "smollm2, a .gguf file, a Hugging Face directory or tiny:SEED[,k=v]"


def check_model(spec: str) -> None:
    """Refuse a ``--model`` that names nothing (``ValueError``), without loading it.

    NOTE: every engine service would fail on it only after the stack started; this is the same
    resolution they use (``model_spec``, ``model_source``), done once, before anything starts.
    """
    if spec.startswith("tiny:"):
        tiny_kwargs(spec)
        return
    if spec != "smollm2" and not Path(spec).exists():
        raise ValueError(f"model: {spec}: no such file or directory (expected {MODEL_FORMS})")
    try:
        source = resolve_model_source(spec)
        if not source.is_gguf:  # the files the engines and the gateway read, not their contents
            source.hf_config()
            source.safetensors_files()
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: {exc} (expected {MODEL_FORMS})") from None


@dataclass(frozen=True)
class LinkSettings:
    # 0 means unlimited.
    mbps: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mbps", "delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not value >= 0:  # NOTE: NaN too
                raise ValueError(f"{name}: must be >= 0, got {value}")

    @property
    def shaped(self) -> bool:
        return bool(self.mbps or self.delay_ms or self.jitter_ms)

    def flags(self) -> list[str]:
        return [
            "--mbps",
            str(self.mbps),
            "--delay-ms",
            str(self.delay_ms),
            "--jitter-ms",
            str(self.jitter_ms),
        ]


# A Kubernetes-style DNS label: names a cluster in instance ids, process names and deploy files.
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
CLUSTER_FORM = "name:mbps:delay_ms:main_decodes"
# The one remote cluster of a stack given no clusters (what every MainDecode registered with).
DEFAULT_CLUSTER = "remote"


@dataclass(frozen=True)
class ClusterSpec:
    """One remote cluster: its MainDecodes behind one WAN link of their own."""

    name: str
    link: LinkSettings = field(default_factory=LinkSettings)
    main_decodes: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _DNS_LABEL.fullmatch(self.name):
            raise ValueError(
                f"name: a cluster is named by a DNS label (a-z, 0-9, '-', at most 63), "
                f"got {self.name!r}"
            )
        if not isinstance(self.main_decodes, int) or self.main_decodes < 1:
            raise ValueError(f"main_decodes: at least 1 per cluster, got {self.main_decodes!r}")

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """``name:mbps:delay_ms:main_decodes`` (``pdd up --cluster``); ValueError names the part."""
        parts = text.split(":")
        if len(parts) != 4:
            raise ValueError(f"expected {CLUSTER_FORM}, got {text!r}")
        name, mbps, delay_ms, count = parts
        try:
            link = LinkSettings(float(mbps), float(delay_ms))
        except ValueError as exc:
            raise ValueError(f"{text!r}: mbps and delay_ms must be numbers >= 0 ({exc})") from None
        if not count.isdigit():
            raise ValueError(f"{text!r}: main_decodes must be a whole number, got {count!r}")
        return cls(name, link, int(count))

    def describe(self) -> str:
        """``1000 Mbit/s, 5 ms one-way``: the link as ``pdd up`` prints it."""
        rate = f"{self.link.mbps:g} Mbit/s" if self.link.mbps else "unlimited"
        jitter = f" +{self.link.jitter_ms:g} ms jitter" if self.link.jitter_ms else ""
        return f"{rate}, {self.link.delay_ms:g} ms one-way{jitter}"


# The certificate stems ``StackConfig.tls_dir`` must hold, one per service role.
TLS_ROLES = ("kvstore", "prefill", "relay", "main-decode", "gateway")


@dataclass(frozen=True)
class StackConfig:
    model: str = "smollm2"
    redis_url: str = ""
    gateway_port: int = 50050
    # The gateway's OpenAI-compatible HTTP port; 0 = off.
    http_port: int = 0
    # Every service's /metrics port: consecutive from metrics_port_base, or free ports when it is 0.
    metrics: bool = True
    metrics_port_base: int = 0
    prefill: int = 1
    relay: int = 1
    main_decode: int = 1
    wan: LinkSettings = field(default_factory=LinkSettings)
    # Remote clusters, each its MainDecodes behind one link of its own. () = today's shape: one
    # cluster "remote" of ``main_decode`` instances, each behind a ``wan`` link (with clusters,
    # those two stay at their defaults).
    clusters: tuple[ClusterSpec, ...] = ()
    # Extra flags for every engine-bearing service (e.g. ["--block-size", "8"]).
    engine_flags: tuple[str, ...] = ()
    # Extra flags for MainDecode only, after engine_flags (e.g. a smaller step budget for its ITL).
    main_decode_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    # Extra environment of every service process (each reads only its own variables).
    env: Mapping[str, str] = field(default_factory=dict)
    # A folder of ``make certs`` (``ca.crt``, ``<role>.crt/.key``): every service then speaks
    # mutual TLS with its own role's certificate and takes each RPC only from the roles that call
    # it (``--tls-authorize``). "" = as ``env`` says (plaintext unless PDD_TLS_* are set).
    tls_dir: str = ""
    log_dir: Path = Path("pdd-logs")
    key_prefix: str = "pdd"
    # "on-failure": a service (or the embedded Redis) that exits non-zero is restarted with
    # backoff on its old address; "no": it stays dead (the e2e tests that kill one on purpose).
    restart: str = "no"
    # How long each service may take to print PDD_LISTENING (a loaded host loads models slowly).
    start_timeout_s: float = 120.0
    # CPUs kept for the frontends (the last N this process may use): the gateway, kvstore, Redis,
    # the WAN emulators and every engine service's event loop run there, the engines' steps on
    # the rest (``pdd.server.cpus``: ``--cpus`` / ``--engine-cpus``). 0 = no placement.
    frontend_cpus: int = 0
    # The engines (prefill, relay, MainDecode: one host, its cores shared) step in turns
    # (``PDD_CORE_TURNS``, a lock file in log_dir; ``pdd.serving.core_turns``).
    core_turns: bool = True

    def __post_init__(self) -> None:
        if self.restart not in RESTART_POLICIES:
            raise ValueError(
                f"restart: must be one of {', '.join(RESTART_POLICIES)}, got {self.restart!r}"
            )
        for name in ("prefill", "relay", "main_decode"):
            if getattr(self, name) < (0 if name == "relay" else 1):
                raise ValueError(f"{name}: too few instances ({getattr(self, name)})")
        for name in ("gateway_port", "http_port", "metrics_port_base"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name}: must be in 0..65535, got {getattr(self, name)}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis_url: expected redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.tls_dir:
            lacking = [
                n
                for n in ("ca.crt", *(f"{r}.{x}" for r in TLS_ROLES for x in ("crt", "key")))
                if not (Path(self.tls_dir) / n).is_file()
            ]
            if lacking:
                raise ValueError(
                    f"tls_dir: {self.tls_dir} lacks {', '.join(lacking)} (`make certs` writes them)"
                )
        if self.clusters:
            names = [c.name for c in self.clusters]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"clusters: names must be unique, {', '.join(dup)} repeated")
            if self.main_decode != 1 or self.wan != LinkSettings():
                raise ValueError(
                    "clusters: each cluster sets its own link and MainDecodes; "
                    "leave main_decode and wan at their defaults"
                )
        if self.frontend_cpus < 0:
            raise ValueError(f"frontend_cpus: must be >= 0, got {self.frontend_cpus}")
        Placement.keeping(self.frontend_cpus)  # NOTE: ValueError if it leaves the engines none
        check_model(self.model)

    @property
    def remote_clusters(self) -> tuple[ClusterSpec, ...]:
        """Every remote cluster, the default shape's one "remote" included."""
        return self.clusters or (ClusterSpec(DEFAULT_CLUSTER, self.wan, self.main_decode),)


def role_tls_flags(folder: str, name: str) -> list[str]:
    """Mutual TLS with the certificate of process ``name``'s role (``main_decode-1`` →
    ``main-decode.crt``), and role authorization."""
    role = name.split("-")[0].replace("_", "-")
    base = Path(folder)
    return [
        "--tls-cert",
        str(base / f"{role}.crt"),
        "--tls-key",
        str(base / f"{role}.key"),
        "--tls-ca",
        str(base / "ca.crt"),
        "--tls-client-auth",
        "--tls-authorize",
    ]


def _print_now(line: str) -> None:
    print(line, flush=True)


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Fixed at construction: the CPUs this process may use then (``frontend_cpus``).
        self.placement = Placement.keeping(config.frontend_cpus)
        self.processes: list[Process] = []
        self.redis: subprocess.Popen | None = None
        # The redis-server this stack started (None: it was given ``redis_url``).
        self.redis_binary: RedisBinary | None = None
        self.redis_url = config.redis_url
        # Service name → host:port of its Prometheus /metrics.
        self.metrics: dict[str, str] = {}
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        # MainDecode name → its cluster, and → the name of the WAN emulator in front of it.
        self.cluster_of: dict[str, str] = {}
        self.link_of: dict[str, str] = {}
        # MainDecode name → the address it advertises (its route through its cluster's link).
        self.advertised: dict[str, str] = {}

    def by_name(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    @property
    def gateway(self) -> Process:
        return self.by_name("gateway")

    @property
    def http_address(self) -> str:
        """host:port of the OpenAI-compatible API ("" when off)."""
        return f"127.0.0.1:{self.config.http_port}" if self.config.http_port else ""

    def _metrics_flags(self, name: str) -> list[str]:
        cfg = self.config
        if not cfg.metrics:
            return []
        port = cfg.metrics_port_base + len(self.metrics) if cfg.metrics_port_base else free_port()
        self.metrics[name] = f"127.0.0.1:{port}"
        return ["--metrics-port", str(port)]

    def _start(self, name: str, module: str, args: list[str]) -> Process:
        # NOTE: a free port is only free when it was asked for: until the service binds it, an
        # outgoing connection's ephemeral port (same range) can take it. A start that failed
        # on a /metrics port chosen that way is retried on another (CI saw kvstore fail so).
        retry_port = self.config.metrics and not self.config.metrics_port_base
        for attempt in range(3):
            # NOTE: a cluster's link asks for its /metrics itself (a plain TCP proxy: no TLS).
            full = args if module == "services.wan_link" else [*args, *self._metrics_flags(name)]
            if self.config.tls_dir and module != "services.wan_link":
                full = [*full, *role_tls_flags(self.config.tls_dir, name)]
            if self.placement is not None:
                full = [*full, *self.placement.flags(module)]
            try:
                p = start_module(
                    name,
                    module,
                    [*full, "--log-format", "json"],
                    env=self._env(),
                    log_dir=self.config.log_dir,
                    timeout=self.config.start_timeout_s,
                )
            except UnavailableError as exc:
                taken = "Address already in use" in str(exc).split("\n", 1)[0]
                if not (taken and retry_port and full is not args and attempt < 2):
                    raise
                self.metrics.pop(name, None)
                continue
            self._place(p)
            self.processes.append(p)
            return p
        raise AssertionError("unreachable")

    def _env(self) -> dict[str, str]:
        """A service's extra environment: the engines' turn lock (``core_turns``; by variable,
        not flag, so that another checkout's services, ``pdd bench served --b-code``, start
        whether they know it or not), then ``env``, which wins."""
        cfg = self.config
        turns = {"PDD_CORE_TURNS": str(cfg.log_dir.resolve() / "core-turns.lock")}
        return {**(turns if cfg.core_turns else {}), **cfg.env}

    def _place(self, p: Process) -> None:
        if self.placement is not None and p.module in UNFLAGGED_MODULES:
            self.placement.pin_frontend(p.proc.pid)

    def start(self) -> Stack:
        cfg = self.config
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.redis_url:
                self.redis_binary = redis_binary()
                self.redis, self.redis_url = start_redis(cfg.log_dir, self.redis_binary)
                self._place_redis()
            kv = self._start(
                "kvstore",
                "services.kvstore",
                ["--port", "0", "--redis-url", self.redis_url, "--key-prefix", cfg.key_prefix],
            )
            common = [
                "--port",
                "0",
                "--kvstore",
                kv.address,
                "--model",
                cfg.model,
                *cfg.engine_flags,
            ]
            if cfg.clusters:
                for cluster in cfg.clusters:
                    self._start_cluster(cluster, common)
            else:
                self._start_default_remote(common)
            for i in range(cfg.prefill):
                self._start(
                    f"prefill-{i}", "services.prefill", [*common, "--instance-id", f"prefill-{i}"]
                )
            for i in range(cfg.relay):
                self._start(
                    f"relay-{i}", "services.relay", [*common, "--instance-id", f"relay-{i}"]
                )
            self._start(
                "gateway",
                "services.gateway",
                [
                    "--port",
                    str(cfg.gateway_port),
                    "--kvstore",
                    kv.address,
                    "--model",
                    cfg.model,
                    "--http-port",
                    str(cfg.http_port),
                    *cfg.gateway_flags,
                ],
            )
        except BaseException:
            self.stop()
            raise
        if cfg.restart == "on-failure":
            self.supervise_in_background()
        return self

    def _start_main_decode(
        self, name: str, cluster: str, port: int, advertise: str, common: list[str]
    ) -> None:
        self.cluster_of[name] = cluster
        self.advertised[name] = advertise
        self._start(
            name,
            "services.main_decode",
            [
                *common,
                *self.config.main_decode_flags,
                "--port",
                str(port),
                "--instance-id",
                name,
                "--cluster",
                cluster,
                "--advertise-address",
                advertise,
            ],
        )

    def _start_default_remote(self, common: list[str]) -> None:
        """Today's shape: cluster "remote", each MainDecode behind its own ``wan-<i>``."""
        cfg = self.config
        for i in range(cfg.main_decode):
            name = f"main_decode-{i}"
            md_port = free_port()
            # NOTE: everyone reaches MainDecode through the WAN emulator, so MainDecode
            # advertises the emulator's address, not its own.
            link = self._start(
                f"wan-{i}",
                "services.wan_link",
                ["--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{md_port}", *cfg.wan.flags()],
            )
            self.link_of[name] = link.name
            self._start_main_decode(name, DEFAULT_CLUSTER, md_port, link.address, common)

    def _start_cluster(self, cluster: ClusterSpec, common: list[str]) -> None:
        """One remote cluster: ONE link (``wan-<cluster>``, a route per MainDecode), then them."""
        names = [f"main_decode-{cluster.name}-{i}" for i in range(cluster.main_decodes)]
        md_ports = [free_port() for _ in names]
        # NOTE: listen ports are chosen here (not 0): one process has many routes but prints
        # one PDD_LISTENING line, and a restart must find every route where it was.
        listens = [f"127.0.0.1:{free_port()}" for _ in names]
        routes = [
            f
            for listen, port in zip(listens, md_ports, strict=True)
            for f in ("--route", f"{listen}=127.0.0.1:{port}")
        ]
        link = self._start(
            f"wan-{cluster.name}",
            "services.wan_link",
            [*routes, *cluster.link.flags(), *self._metrics_flags(f"wan-{cluster.name}")],
        )
        for name, port, listen in zip(names, md_ports, listens, strict=True):
            self.link_of[name] = link.name
            self._start_main_decode(name, cluster.name, port, listen, common)

    def supervise_in_background(self, say: Callable[[str], None] | None = None) -> None:
        """Restart what dies until ``stop()`` (a daemon thread; ``pdd up`` prints its lines)."""
        self._stopping.clear()
        supervisor = Supervisor(
            self, say=say or _print_now, log_path=self.config.log_dir / "supervisor.log"
        )
        self._supervisor = threading.Thread(
            target=supervisor.run, args=(self._stopping,), name="pdd-supervisor", daemon=True
        )
        self._supervisor.start()

    def restart(self, name: str) -> Process:
        """Start ``name`` again with its command line, on the address it had; returns at once.

        The new process takes the old one's place in ``processes`` (so ``stop()`` reaches it);
        its ``address`` is filled in once it listens again.
        """
        i, old = next((i, p) for i, p in enumerate(self.processes) if p.name == name)
        old.stop(timeout=5)
        new = spawn_module(
            name,
            old.module,
            pinned_args(old.module, old.args, old.address),
            env=dict(self.config.env),
            log_dir=self.config.log_dir,
        )
        self._place(new)
        self.processes[i] = new
        return new

    def _place_redis(self) -> None:
        if self.placement is not None and self.redis is not None:
            self.placement.pin_frontend(self.redis.pid)

    def restart_redis(self, timeout: float = 10.0) -> None:
        """Start the embedded Redis again with its command line (so its port), wait for PONG."""
        old = self.redis
        if old is None:
            raise UnavailableError("redis: this stack did not start one (it was given redis_url)")
        with open(self.config.log_dir / "redis.log", "a") as log:
            self.redis = subprocess.Popen(
                old.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._place_redis()
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.redis.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise UnavailableError(f"redis did not come back on port {port}")

    def stop(self) -> dict[str, int]:
        # NOTE: the supervisor goes first, so nothing is restarted while the stack stops.
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=30)
            self._supervisor = None
        codes = {p.name: p.stop() for p in reversed(self.processes)}
        self.processes.clear()
        self.metrics.clear()
        self.cluster_of.clear()
        self.link_of.clear()
        self.advertised.clear()
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
            self.redis = None
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
