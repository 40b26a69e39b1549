"""The three serving modes of the comparison, as stack and load settings.

A mode is a deployment, not a flag: each gets its own stack (fresh Redis,
fresh DRC), built from one ``Testbed`` (model, engine sizes, WAN), so the
three differ only where the mode says they do (docs/benchmark.md):

  idc-pd  P → MD over an unshaped link (the same-datacenter baseline): no
          relay, the WAN emulator passes bytes at full speed, no delay.
  cdc-pd  P → MD through the shaped WAN, DRC on (MD's radix cache is always
          on; P sends only the delta), no relay: every request is P-MD and its
          user waits for the delta to cross the WAN.
  pdd     the same shaped WAN plus one relay: the router sends low-hit
          requests (< θ) P-RLD-MD, high-hit ones P-MD.

Why a fresh stack per mode: MainDecode's DRC and prefill's radix cache are
the state under test. A shared stack would let the second mode run on the
first mode's warm caches (or, salted apart, on a fuller KV pool); fresh
stacks give each mode the same cold start and the same trace history.

Why idc-pd/cdc-pd also force ``p-md``: on a stack the bench starts they have no
relay, so the router picks P-MD anyway; on an external stack (``--gateway``)
that has a relay the force keeps the mode honest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdd.testbed.stack import LinkSettings, StackConfig

MODES = ("idc-pd", "cdc-pd", "pdd")
ENGINES = ("pdd", "vllm")  # pdd.engine.protocol.EngineKind's values

# Random-weight Llama: 256 hidden, 4 layers, 2 KV heads × 64 → 4 KiB of fp32 KV per token;
# a decode step of a few ms on one CPU thread (measured by ``calibrate.idle_step_ms``).
TESTBED_MODEL = "tiny:1,vocab=4096,hidden=256,inter=768,layers=4,heads=4,kv_heads=2,ctx=4096"


@dataclass(frozen=True)
class Testbed:
    """Everything the three modes share: model, engine sizes, the WAN of the shaped modes."""

    model: str = TESTBED_MODEL
    block_size: int = 16
    kv_cache_mb: int = 256
    # MainDecode's per-step token budget: a smaller one than prefill's 2048 keeps a local prefill or a
    # catch-up extension from stretching one step (every co-running stream's ITL, a handoff's wait).
    md_max_batched_tokens: int = 128
    # torch threads per engine service: 3 engines share 2 cores.
    threads: int = 1
    # The cross-datacenter WAN (cdc-pd and pdd), scaled in decode steps (docs/benchmark.md): the report's
    # whole-context KV crosses 20 Gbps in ~4.2 s ≈ 140 decode steps of ~30 ms; here a mean context's KV
    # (1.4K tokens × 4 KB) crosses 80 Mbps in ~0.55 s ≈ 150 loaded MainDecode steps of ~3.5 ms (the paged
    # decode kernel halved the step; at the 40 Mbps this was tuned to before, it took ~300 and low-hit
    # requests finished on the relay). A low-hit delta (1-4 MB) still takes hundreds of relay steps, a
    # > 95%-hit one (≤ 0.5 MB) a handful. 1 ms one way is ~0.3 of a loaded step (a regional link's few
    # ms are ~0.1 of a 30 ms step): the userspace emulator's delay is not finer than that.
    wan_mbps: float = 80.0
    wan_delay_ms: float = 1.0
    wan_jitter_ms: float = 0.5
    hit_threshold: float = 0.95
    # PDD's router lets MainDecode prefill a predicted uncached suffix of at most this many tokens itself
    # (pipeline MD): on this testbed computing 256 tokens costs MainDecode ~1-2 batched steps, while their
    # KV (1 MB) takes ~0.4 s of the 20 Mbps WAN plus prefill's queue. 0 = the design's P-MD for every hit.
    local_prefill_tokens: int = 256
    relay_busy_requests: int = 4
    router_seed: int = 0
    # The relay stops catching up once MainDecode's computed frontier is at most this many tokens behind
    # (relay flag --catch-up-gap, the relay's default; passed as PDD_CATCH_UP_GAP: stack flags reach every
    # engine).
    catch_up_gap: int = 8
    # The relay streams no faster than MainDecode decodes during a catch-up, holding a token at most this
    # long (relay flag --pace-max-hold-ms, the relay's default; 0 = off, the ablation).
    pace_max_hold_ms: float = 50.0
    # The relay's playout lead (relay flag --stream-lead-ms): None = auto, learned from recent switches
    # (the relay's default); 0 = none, the ablation.
    stream_lead_ms: float | None = None
    # Main and remote cluster on separate CPUs (``pinning``), as on separate hardware.
    pin_clusters: bool = True
    # The engine of prefill, relay and MainDecode: ours, or vLLM in each service (pdd[vllm]; the
    # services run on this Python, so vLLM must import here: ``runner.testbed_from`` checks).
    engine: str = "pdd"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: required")
        for name in (
            "block_size",
            "kv_cache_mb",
            "threads",
            "relay_busy_requests",
            "md_max_batched_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: must be >= 0, got {self.local_prefill_tokens}")
        if self.catch_up_gap < 0:
            raise ValueError(f"catch_up_gap: must be >= 0, got {self.catch_up_gap}")
        if self.pace_max_hold_ms < 0:
            raise ValueError(f"pace_max_hold_ms: must be >= 0, got {self.pace_max_hold_ms}")
        if self.stream_lead_ms is not None and self.stream_lead_ms < 0:
            raise ValueError(
                f"stream_lead_ms: must be >= 0 or None (auto), got {self.stream_lead_ms}"
            )
        if self.wan_mbps <= 0:
            raise ValueError(
                f"wan_mbps: the cross-datacenter modes need a finite WAN, got {self.wan_mbps}"
            )
        if self.wan_delay_ms < 0 or self.wan_jitter_ms < 0:
            raise ValueError("wan_delay_ms: delay and jitter must be >= 0")
        if not 0.0 <= self.hit_threshold <= 1.0:
            raise ValueError(f"hit_threshold: must be in [0, 1], got {self.hit_threshold}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: must be one of {ENGINES}, got {self.engine!r}")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
    return mode


def relays(mode: str) -> int:
    return 1 if check_mode(mode) == "pdd" else 0


def link(mode: str, testbed: Testbed) -> LinkSettings:
    """The P ↔ MD link of ``mode``: unshaped for idc-pd, the testbed's WAN otherwise."""
    if check_mode(mode) == "idc-pd":
        return LinkSettings()
    return LinkSettings(testbed.wan_mbps, testbed.wan_delay_ms, testbed.wan_jitter_ms)


def link_record(mode: str, testbed: Testbed) -> dict:
    """What a RESULT says about the run's deployment (its ``link`` field)."""
    wan = link(mode, testbed)
    return {
        "mbps": wan.mbps,
        "delay_ms": wan.delay_ms,
        "jitter_ms": wan.jitter_ms,
        "relays": relays(mode),
        "model": testbed.model,
        # NOTE: only when not ours, so the records of runs on our engine keep their shape.
        **({"engine": testbed.engine} if testbed.engine != "pdd" else {}),
    }


def clusters_record(config: StackConfig, testbed: Testbed) -> dict:
    """A RESULT's ``link`` for a stack of several remote clusters: each one's link and size."""
    return {
        "clusters": [
            {
                "name": c.name,
                "mbps": c.link.mbps,
                "delay_ms": c.link.delay_ms,
                "jitter_ms": c.link.jitter_ms,
                "main_decodes": c.main_decodes,
            }
            for c in config.remote_clusters
        ],
        "relays": config.relay,
        "model": testbed.model,
        **({"engine": testbed.engine} if testbed.engine != "pdd" else {}),
    }


def stack_config(
    mode: str,
    testbed: Testbed,
    *,
    log_dir: Path,
    redis_url: str = "",
    gateway_port: int = 0,
    key_prefix: str = "pdd",
) -> StackConfig:
    """The stack ``mode`` runs on: one prefill, one MainDecode, a relay for pdd only."""
    engine = (
        "--block-size",
        str(testbed.block_size),
        "--kv-cache-mb",
        str(testbed.kv_cache_mb),
        "--threads",
        str(testbed.threads),
        "--engine",
        testbed.engine,
    )
    gateway = (
        "--hit-threshold",
        str(testbed.hit_threshold),
        "--local-prefill-tokens",
        str(testbed.local_prefill_tokens),
        "--relay-busy-requests",
        str(testbed.relay_busy_requests),
        "--seed",
        str(testbed.router_seed),
    )
    return StackConfig(
        model=testbed.model,
        redis_url=redis_url,
        gateway_port=gateway_port,
        prefill=1,
        relay=relays(mode),
        main_decode=1,
        wan=link(mode, testbed),
        engine_flags=engine,
        main_decode_flags=("--max-num-batched-tokens", str(testbed.md_max_batched_tokens)),
        env=stack_env(testbed),
        gateway_flags=gateway,
        log_dir=log_dir,
        key_prefix=key_prefix,
    )


def stack_env(testbed: Testbed) -> dict[str, str]:
    """Environment the stack's services start with (each reads only its own variables)."""
    lead = "auto" if testbed.stream_lead_ms is None else str(testbed.stream_lead_ms)
    return {
        "PDD_CATCH_UP_GAP": str(testbed.catch_up_gap),
        "PDD_PACE_MAX_HOLD_MS": str(testbed.pace_max_hold_ms),
        "PDD_STREAM_LEAD_MS": lead,
    }


def load_overrides(mode: str) -> dict:
    """``LoadConfig`` fields every run of ``mode`` uses: greedy, exact lengths, and the mode's pipeline."""
    force = "" if check_mode(mode) == "pdd" else "p-md"
    return {"temperature": 0.0, "ignore_eos": True, "force_pipeline": force}
