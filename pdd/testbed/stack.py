"""The whole PDD stack on one machine, each service its own process.

Life of ``pdd up``: Redis (an embedded real server unless a URL is given) →
kvstore → main_decode instances, each behind a WAN link emulator (so every
byte to the "remote" cluster crosses the emulated link) → prefill and relay
instances → gateway (with the OpenAI-compatible HTTP API when ``http_port``
is set). Each prints where it listens; every service but the WAN emulators
serves Prometheus ``/metrics`` on its own port (``metrics``); ``stop()``
sends SIGTERM to all, in reverse order. With ``restart="on-failure"`` a
supervisor thread (``pdd.testbed.supervisor``) restarts a service that dies,
on the address it had, with backoff.
"""

from __future__ import annotations

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
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

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
    # Extra flags for every engine-bearing service (e.g. ["--block-size", "8"]).
    engine_flags: tuple[str, ...] = ()
    # Extra flags for MainDecode only, after engine_flags (e.g. a smaller step budget for its ITL).
    main_decode_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    # Extra environment of every service process (each reads only its own variables).
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path = Path("pdd-logs")
    key_prefix: str = "pdd"
    # "on-failure": a service (or the embedded Redis) that exits non-zero is restarted with
    # backoff on its old address; "no": it stays dead (the e2e tests that kill one on purpose).
    restart: str = "no"

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
        check_model(self.model)


def _print_now(line: str) -> None:
    print(line, flush=True)


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: list[Process] = []
        self.redis: subprocess.Popen | None = None
        # The redis-server this stack started (None: it was given ``redis_url``).
        self.redis_binary: RedisBinary | None = None
        self.redis_url = config.redis_url
        # Service name → host:port of its Prometheus /metrics.
        self.metrics: dict[str, str] = {}
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()

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
        if module != "services.wan_link":
            args = [*args, *self._metrics_flags(name)]
        p = start_module(
            name,
            module,
            [*args, "--log-format", "json"],
            env=dict(self.config.env),
            log_dir=self.config.log_dir,
        )
        self.processes.append(p)
        return p

    def start(self) -> Stack:
        cfg = self.config
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.redis_url:
                self.redis_binary = redis_binary()
                self.redis, self.redis_url = start_redis(cfg.log_dir, self.redis_binary)
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
            for i in range(cfg.main_decode):
                name = f"main_decode-{i}"
                md_port = free_port()
                # NOTE: everyone reaches MainDecode through the WAN emulator, so MainDecode
                # advertises the emulator's address, not its own.
                link = self._start(
                    f"wan-{i}",
                    "services.wan_link",
                    [
                        "--listen",
                        "127.0.0.1:0",
                        "--upstream",
                        f"127.0.0.1:{md_port}",
                        *cfg.wan.flags(),
                    ],
                )
                self._start(
                    name,
                    "services.main_decode",
                    [
                        *common,
                        *cfg.main_decode_flags,
                        "--port",
                        str(md_port),
                        "--instance-id",
                        name,
                        "--cluster",
                        "remote",
                        "--advertise-address",
                        link.address,
                    ],
                )
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
        self.processes[i] = new
        return new

    def restart_redis(self, timeout: float = 10.0) -> None:
        """Start the embedded Redis again with its command line (so its port), wait for PONG."""
        old = self.redis
        if old is None:
            raise UnavailableError("redis: this stack did not start one (it was given redis_url)")
        with open(self.config.log_dir / "redis.log", "a") as log:
            self.redis = subprocess.Popen(
                old.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
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
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
            self.redis = None
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
