"""``pdd chaos``'s settings: the faults it knows, when each is injected, the request list, the stack."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from pathlib import Path

from pdd.gen.common.v1 import common_pb2
from pdd.testbed.stack import LinkSettings, StackConfig

# Fault → the pipeline its requests are forced onto ("" = the router's choice).
FAULTS = {
    "main_decode": "p-md",
    "main_decode_relayed": "p-rld-md",
    "prefill": "p-md",
    "relay": "p-rld-md",
    "kvstore": "",
    "redis": "",
    "wan_partition": "p-md",
}
PIPELINES = {
    "": 0,
    "p-md": common_pb2.PIPELINE_P_MD,
    "p-rld-md": common_pb2.PIPELINE_P_RLD_MD,
}
# When each fault is injected (the README's table repeats it).
MOMENTS = {
    "main_decode": ">= N in flight; SIGKILL the MainDecode holding the KV of most of those that "
    "streamed a token",
    "main_decode_relayed": ">= N in flight; SIGKILL the MainDecode most of those the relay "
    "streams are bound for, before their handoff (the WAN delay holds their KV back)",
    "prefill": ">= N in flight; SIGKILL the prefill holding an in-flight request's KV",
    "relay": ">= N in flight; SIGKILL the relay once it holds one that streamed a token (not yet "
    "handed off)",
    "kvstore": ">= N in flight",
    "redis": ">= N in flight",
    "wan_partition": ">= N in flight; SIGSTOP the WAN emulator in front of the MainDecode "
    "holding the KV of most of those that streamed a token, SIGCONT after partition_s",
}
SEEDED_TEMPERATURE = 0.8
TINY = "tiny:7,ctx=512"
BLOCK = 4


@dataclass(frozen=True)
class ChaosConfig:
    out: Path = Path("pdd-chaos")
    faults: tuple[str, ...] = tuple(FAULTS)
    requests: int = 16
    # Seconds between two requests' starts.
    interval_s: float = 0.15
    # Inject once at least this many requests are in flight.
    in_flight: int = 4
    min_tokens: int = 96
    max_tokens: int = 160
    seed: int = 0
    wan_delay_ms: float = 200.0
    partition_s: float = 3.0
    # Every request's deadline (a hang ends as DEADLINE_EXCEEDED).
    request_timeout_s: float = 60.0
    # The gateway's longest wait for a stage.
    stage_timeout_s: float = 20.0
    # How long recovery is probed before it is reported as "never".
    recover_timeout_s: float = 90.0
    drain_s: float = 2.0
    model: str = TINY

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown or not self.faults:
            raise ValueError(f"faults: choose from {', '.join(FAULTS)}, got {list(self.faults)}")
        for name in ("requests", "in_flight", "min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens: must be >= min_tokens ({self.min_tokens})")
        if self.in_flight > self.requests:
            raise ValueError(f"in_flight: must be <= requests ({self.requests})")
        for name in (
            "interval_s",
            "partition_s",
            "request_timeout_s",
            "stage_timeout_s",
            "recover_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("wan_delay_ms", "drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ChaosRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    # None: greedy.
    seed: int | None


def chaos_requests(cfg: ChaosConfig) -> list[ChaosRequest]:
    """The fixed request list: every other one greedy, the rest sampled with their own seed."""
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.requests):
        prompt = tuple(rng.randrange(1, 256) for _ in range(rng.randrange(32, 200)))
        n = rng.randrange(cfg.min_tokens, cfg.max_tokens + 1)
        out.append(ChaosRequest(i, prompt, n, None if i % 2 == 0 else 1000 + i))
    return out


def stack_config(cfg: ChaosConfig) -> StackConfig:
    return StackConfig(
        model=cfg.model,
        gateway_port=0,
        metrics=False,
        prefill=2,
        relay=1,
        main_decode=2,
        wan=LinkSettings(delay_ms=cfg.wan_delay_ms),
        engine_flags=(
            "--block-size",
            str(BLOCK),
            "--kv-cache-mb",
            "32",
            "--threads",
            "1",
            "--lease-ttl-ms",
            "3000",
        ),
        gateway_flags=("--seed", "0", "--stage-timeout-s", str(cfg.stage_timeout_s)),
        log_dir=cfg.out / "logs",
        key_prefix=f"chaos{uuid.uuid4().hex[:8]}",
        restart="on-failure",
    )
