"""What one simulated run is: the workload, the deployment (pools and chips), the links, the
router's settings and the SLA (``simulator.simulate`` runs it, ``economics`` and ``plan`` vary
it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdd.bench.trace import DISTS
from pdd.routing.policy import RoutingConfig


@dataclass(frozen=True)
class SimConfig:
    profile: str = "report"
    # Workload (the generator's; ``requests`` from a trace replace it).
    dist: str = "skewed"
    rps: float = 11.5
    duration_s: float = 600.0
    warmup_s: float = 60.0
    seed: int = 0
    context_tokens: int = 65536
    live_sessions: int = 512
    output_tokens: int = 0  # 0 = the report's output buckets
    output_scale: float = 1.0
    # Deployment: instances of each pool, the chips they run on.
    prefill_instances: int = 8
    # The report's relay: "3 GPU-A nodes, the minimum to run DeepSeek-V4-pro with DP" — one
    # instance of the report profile's unit (an instance is 3 nodes of 8 GPUs).
    relay_instances: int = 1
    md_instances: int = 8
    remote_clusters: int = 1
    idc_prefill_instances: int = 8
    idc_decode_instances: int = 8
    prefill_chip: str = "flagship"
    relay_chip: str = "flagship"
    md_chip: str = "bandwidth"
    idc_decode_chip: str = "flagship"
    # MainDecode's per-step budget of prefill/extend tokens (0 = the chip's prefill_chunk_tokens).
    md_chunk_tokens: int = 0
    # Links: 0 = the profile's value.
    wan_gbps: float = 0.0
    wan_delay_ms: float = -1.0
    pool_streams: int = 0
    # KV bytes per token as the engine holds it (0 = the profile's; the wire ratio applies on top).
    kv_bytes_per_token: int = 0
    # Stream each prefill chunk's KV as it is computed (the live prefill); False: after prefill.
    stream_kv: bool = True
    # The router (pdd.routing.RoutingConfig's fields).
    hit_threshold: float = 0.95
    local_prefill_tokens: int = 0
    tokens_per_load_unit: int = 256
    relay_busy_requests: int = 4
    max_kv_usage: float = 0.95
    # "threshold": the report's router (θ on the predicted hit); "link_aware": the live gateway's
    # default since router v2 (the relay only when the delta's estimated transfer on the measured
    # link exceeds the budget: ``ttft_budget_ratio`` × the run's recent median TTFT, or
    # ``ttft_budget_s`` until one is known; θ until the link is measured).
    pipeline_policy: str = "threshold"
    ttft_budget_ratio: float = RoutingConfig.ttft_budget_ratio
    ttft_budget_s: float = 0.5
    # The SLA on TTFT, as the report's.
    sla_p90_s: float = 10.0
    sla_p99_s: float = 15.0

    def __post_init__(self) -> None:
        if self.dist not in DISTS:
            raise ValueError(f"dist: must be one of {DISTS}, got {self.dist!r}")
        for name, value in asdict(self).items():
            if name == "wan_delay_ms":
                continue
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        for name in (
            "rps",
            "duration_s",
            "context_tokens",
            "live_sessions",
            "prefill_instances",
            "md_instances",
            "remote_clusters",
            "idc_prefill_instances",
            "idc_decode_instances",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.output_scale < 1:
            raise ValueError(f"output_scale: must be >= 1, got {self.output_scale}")
        if self.remote_clusters > self.md_instances:
            raise ValueError("remote_clusters: each remote cluster needs a MainDecode instance")
        self.routing()  # NOTE: the router validates its own fields, once

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            hit_threshold=self.hit_threshold,
            local_prefill_tokens=self.local_prefill_tokens,
            tokens_per_load_unit=self.tokens_per_load_unit,
            relay_busy_requests=max(1, self.relay_busy_requests),
            max_kv_usage=self.max_kv_usage,
            pipeline_policy=self.pipeline_policy,
            ttft_budget_ratio=self.ttft_budget_ratio,
            ttft_budget_s=self.ttft_budget_s,
        )
