"""What prefill, relay and main_decode share: an engine, its loop, its membership.

Life: ``start()`` builds the engine (loading the model), starts its step loop
and registers the instance with kvstore; cache events of the engine's radix
cache are forwarded to kvstore in order, and when kvstore forgot the instance
(lease lapsed) the whole cache is republished as a snapshot read on the engine
thread; ``stop()`` deregisters and stops.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceLoad, InstanceRef
from pdd.core.link_state import LinkState
from pdd.core.stage_events import CacheReport
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.protocol import EngineBackend, EngineKind
from pdd.server import cpus as cpu_lists
from pdd.server.tls import TlsConfig, open_channel
from pdd.serving.admission import AdmissionConfig
from pdd.serving.core_turns import CoreTurns
from pdd.serving.engine_loop import Coalesce, EngineLoop
from pdd.serving.membership import DEFAULT_LEASE_TTL_MS, Membership
from pdd.serving.model_spec import load_model
from pdd.telemetry import metrics
from pdd.wire.kvstore_client import KvstoreClient

log = structlog.get_logger(__name__)


def hf_model_dir(spec: str) -> Path:
    """``--model`` as a Hugging Face directory (what vLLM loads): a ``tiny:`` spec is written as
    one, once per spec, so vLLM and our engine run the same weights."""
    if not spec.startswith("tiny:"):
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise ValueError(f"model: the vLLM engine needs a Hugging Face directory, got {spec!r}")
        return path
    root = Path(tempfile.gettempdir()) / "pdd-vllm-models"
    path = root / re.sub(r"[^A-Za-z0-9_.=,-]", "_", spec)
    if not (path / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=root))
        load_model(spec).save_hf(scratch)
        try:
            os.rename(scratch, path)  # NOTE: atomic: services starting together race here
        except OSError:
            pass  # another process wrote it first (same spec, same weights)
    return path


@dataclass(frozen=True)
class InstanceConfig:
    ref: InstanceRef
    kvstore_address: str
    model: str
    engine: EngineConfig
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS
    # Which engine runs the role: ours (the default) or vLLM in this process (``pdd.engine_vllm``).
    engine_kind: EngineKind = EngineKind.PDD
    # torch intra-op threads; 0 keeps torch's default (with engine_cpus: one per CPU of them).
    threads: int = 0
    # The CPUs of the engine thread and the OpenMP team it starts (``pdd.server.cpus``); the
    # service's other threads stay on its ``ServerConfig.cpus``. None = no placement.
    engine_cpus: frozenset[int] | None = None
    # The role's bounded admission (requests, reserved KV tokens); beyond it: RESOURCE_EXHAUSTED.
    admission: AdmissionConfig = AdmissionConfig()
    # vLLM's tensor-parallel degree (its workers are processes of their own); our engine: 1.
    tensor_parallel_size: int = 1
    # An idle engine's first step waits for a burst (``engine_loop.Coalesce``): while requests
    # keep arriving, each within burst_gap_ms of the last, for up to burst_wait_ms; 0 = at once.
    burst_wait_ms: float = 0.0
    burst_gap_ms: float = 2.0
    # A lock file shared by the engines of one host that share its cores: each step holds it,
    # so they step in turns (``pdd.serving.core_turns``; ``pdd up`` gives its engines one).
    # "" = step whenever there is work.
    core_turns: str = ""

    def __post_init__(self) -> None:
        if self.lease_ttl_ms < 300:
            raise ValueError(f"lease_ttl_ms: must be >= 300, got {self.lease_ttl_ms}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0, got {self.threads}")
        cpu_lists.check("engine_cpus", self.engine_cpus)
        if self.engine_cpus is not None and self.threads > len(self.engine_cpus):
            raise ValueError(
                f"threads: must be <= the {len(self.engine_cpus)} CPUs of engine_cpus "
                f"({cpu_lists.format_cpus(self.engine_cpus)}), got {self.threads}"
            )
        if self.burst_wait_ms < 0:
            raise ValueError(f"burst_wait_ms: must be >= 0, got {self.burst_wait_ms}")
        if self.burst_gap_ms <= 0:
            raise ValueError(f"burst_gap_ms: must be > 0, got {self.burst_gap_ms}")
        if self.core_turns and not os.path.isdir(os.path.dirname(os.path.abspath(self.core_turns))):
            raise ValueError(
                f"core_turns: the lock file's directory does not exist, got {self.core_turns!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.engine_kind is not EngineKind.VLLM:
            raise ValueError(
                "tensor_parallel_size: only the vLLM engine (--engine vllm) runs tensor-parallel, "
                f"got {self.tensor_parallel_size} with --engine {self.engine_kind.value}"
            )


class EngineInstance:
    def __init__(
        self,
        config: InstanceConfig,
        *,
        tls: TlsConfig = TlsConfig(),
        publish_cache_events: bool = True,
    ) -> None:
        self.config = config
        # TLS of the channel to kvstore: the service passes its own (ServerConfig.tls).
        self.tls = tls
        self.publish_cache_events = publish_cache_events
        self.engine: EngineBackend | None = None
        self.runner: EngineLoop | None = None
        self.turns: CoreTurns | None = None
        self.membership: Membership | None = None
        self._kvstore_channel = None  # opened by register(), closed by stop()
        # The WAN links' states reported with the load (prefill sets its meters':
        # ``pdd.kv.link_meter``); none for the other roles.
        self.link_states: Callable[[], tuple[LinkState, ...]] = tuple

    @property
    def threads(self) -> int:
        """The engine's intra-op threads: as configured, else one per engine CPU (0: torch's)."""
        cfg = self.config
        return cfg.threads or (len(cfg.engine_cpus) if cfg.engine_cpus is not None else 0)

    async def start(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        cfg = self.config
        if cfg.core_turns:
            self.turns = CoreTurns(
                cfg.core_turns, metrics.CORE_TURN_WAIT.labels(cfg.ref.role.value).inc
            )
            log.info("core_turns", path=cfg.core_turns)
        self.runner = await EngineLoop.build(self._build_engine, self._coalesce(), self.turns)
        self.engine = self.runner.engine
        metrics.LIVE.watch_engine(cfg.ref.instance_id, cfg.ref.role.value, lambda: self.engine)

    def _coalesce(self) -> Coalesce | None:
        cfg = self.config
        if cfg.burst_wait_ms == 0:
            return None
        wait_s = cfg.burst_wait_ms / 1000
        return Coalesce(max_s=wait_s, gap_s=min(cfg.burst_gap_ms / 1000, wait_s))

    def _build_engine(self) -> EngineBackend:
        """The chosen engine, its model loaded (on a worker thread: minutes for vLLM)."""
        cfg = self.config
        # NOTE: first, on the engine thread itself: the OpenMP team its first parallel step
        # starts inherits its CPUs (the team's size is ``start``'s set_num_threads).
        cpu_lists.place(cfg.engine_cpus)
        if cfg.engine_kind is EngineKind.VLLM:
            if self.threads:
                # NOTE: vLLM cuts torch to one thread "for serving" in its engine-core process
                # unless OMP_NUM_THREADS is set; here that process is this service.
                os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))
            if cfg.engine_cpus is not None:
                # NOTE: vLLM's CPU worker binds its OpenMP threads itself, to this list.
                os.environ.setdefault(
                    "VLLM_CPU_OMP_THREADS_BIND", cpu_lists.format_cpus(cfg.engine_cpus)
                )
            # NOTE: imported only on this choice: vLLM is an optional extra (pdd[vllm]).
            from pdd.engine_vllm.engine import VllmEngine

            return VllmEngine(
                hf_model_dir(cfg.model),
                cfg.engine,
                self._on_cache_event,
                tensor_parallel_size=cfg.tensor_parallel_size,
            )
        return Engine(load_model(cfg.model), cfg.engine, self._on_cache_event)

    async def register(self, port: int) -> None:
        """Join the stack (kvstore) once the gRPC server accepts calls on ``port``."""
        cfg = self.config
        ref = cfg.ref
        if ref.address.endswith(":0"):  # NOTE: no advertised address: the bound one
            ref = InstanceRef(
                ref.instance_id, f"{ref.address.rpartition(':')[0]}:{port}", ref.role, ref.cluster
            )
        assert self.engine is not None
        self._kvstore_channel = open_channel(cfg.kvstore_address, self.tls)
        self.membership = Membership(
            KvstoreClient(self._kvstore_channel),
            Instance(ref, self.engine.block_size, cfg.model),
            ttl_ms=cfg.lease_ttl_ms,
            load=self.load,
            snapshot=self._snapshot,
        )
        await self.membership.start()
        log.info(
            "instance_ready",
            address=ref.address,
            instance_id=cfg.ref.instance_id,
            role=cfg.ref.role.value,
            blocks=self.engine.num_blocks,
            block_size=self.engine.block_size,
            dtype=str(self.engine.dtype),
        )

    async def stop(self) -> None:
        metrics.LIVE.forget(self.config.ref.instance_id)
        if self.membership is not None:
            await self.membership.stop()
        if self._kvstore_channel is not None:
            await self._kvstore_channel.close()
        if self.runner is not None:
            await self.runner.stop()
        if self.turns is not None:
            self.turns.close()  # NOTE: after the engine thread, which steps under it, ended

    def _on_cache_event(self, event: CacheEvent) -> None:
        # NOTE: runs on the engine thread; hop to the event loop to keep event order.
        if self.publish_cache_events and self.runner is not None and self.membership is not None:
            membership = self.membership
            self.runner.call_threadsafe(lambda: membership.publish(event))

    async def _snapshot(self) -> list[CacheEvent]:
        """The radix cache's content as "stored" events, for kvstore to rebuild a dropped index."""
        eng = self.engine
        if not self.publish_cache_events or eng is None or self.runner is None:
            return []
        # NOTE: the radix cache belongs to the engine thread; read it there, between steps.
        return await self.runner.call(eng.cache_snapshot)

    def load(self) -> InstanceLoad:
        eng = self.engine
        if eng is None:
            return InstanceLoad()
        used, total = eng.kv_usage()
        running, _, _ = eng.request_counts()
        return InstanceLoad(
            running_requests=running,
            waiting_requests=0,
            kv_blocks_used=used,
            kv_blocks_total=total,
            links=self.link_states(),
        )

    async def describe(self, token_ids: list[int], salt: str, request_id: str) -> CacheReport:
        eng = self.engine
        assert eng is not None and self.runner is not None

        def read() -> CacheReport:
            used, total = eng.kv_usage()
            return CacheReport(
                eng.prefix_match_len(token_ids, salt) if token_ids else 0,
                used,
                total,
                bool(request_id) and eng.holds_request(request_id),
                eng.block_size,
            )

        return await self.runner.call(read)
