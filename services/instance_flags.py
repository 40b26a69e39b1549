"""Flags of an engine-bearing service (prefill, relay, main_decode): its instance and engine.

Each flag derives from an ``InstanceRef``/``InstanceConfig``/``EngineConfig`` field by the rule of
``pdd.server.settings``; the role picks the defaults a field does not have (id, cluster).
"""

from __future__ import annotations

import argparse

from pdd.core.instance import InstanceRef, Role
from pdd.engine.config import EngineConfig
from pdd.server.cpus import parse_cpus
from pdd.server.settings import MB, Flag, Settings
from pdd.serving.admission import AdmissionConfig
from pdd.serving.engine_instance import InstanceConfig
from services.stack_defaults import KVSTORE_ADDRESS, MODEL

INSTANCE_REF = Settings(
    InstanceRef,
    Flag("instance_id"),
    Flag("cluster"),
    Flag(
        "address",
        "host:port others use to reach this instance (default: the bound address)",
        name="advertise-address",
    ),
    title="instance",
)
INSTANCE = Settings(
    InstanceConfig,
    Flag("kvstore_address", "host:port of kvstore", name="kvstore"),
    Flag("model", "smollm2 | PATH (.gguf or HF dir) | tiny:SEED[,k=v]"),
    Flag("lease_ttl_ms", "kvstore forgets an instance silent this long"),
    Flag("threads", "torch intra-op threads, 0 = torch's default (one per --engine-cpus CPU)"),
    Flag(
        "engine_cpus",
        'CPUs of the engine thread and its OpenMP team, e.g. 0-5 ("" = any); the service\'s '
        "other threads stay on --cpus",
        parse=parse_cpus,
    ),
    Flag(
        "engine_kind", "the engine: pdd (ours) | vllm (needs pip install pdd[vllm])", name="engine"
    ),
    Flag(
        "tensor_parallel_size",
        "vLLM's tensor-parallel degree (--engine vllm; its workers are processes of their own)",
    ),
    Flag(
        "burst_wait_ms",
        "an idle engine's first step waits up to this long for a burst's other requests; 0 = none",
    ),
    Flag("burst_gap_ms", "the burst is over when no request arrives within this long"),
    Flag(
        "core_turns",
        "lock file shared by the engines of one host that share its cores: they step in turns "
        '("" = never wait; pdd up gives its engines one)',
    ),
    title="instance",
)
# NOTE: prefill and MainDecode gather a burst before an idle engine's first step (see
# pdd.serving.engine_loop): a burst's requests reach them a few ms apart, and a prefill step is
# long. The relay steps at once (its requests come one by one off prefill's steps).
# Measured (16 requests sent at once through the gateway, one host): they reach prefill over
# ~40 ms, up to ~3.5 ms apart; with 10 / 2 ms the first step took 2-5 of them and the rest
# waited that whole step (served 803-808 tok/s); with 40 / 4 ms one step took all 16 (846-867).
# MainDecode (pipeline MD, the prefill its own): without it every round's first step took one or
# two requests alone, TTFT P50 390-441 ms; with 40 / 4 ms one step took all 16, 357-369 ms.
BURST_WAIT_MS = 40.0
BURST_GAP_MS = 4.0
ENGINE = Settings(
    EngineConfig,
    Flag("block_size", "tokens per KV block"),
    Flag("kv_cache_bytes", "KV pool size", unit=MB),
    Flag("max_num_seqs", "running requests at once"),
    Flag("max_num_batched_tokens", "per-step token budget"),
    Flag("dtype", "compute/KV dtype, '' = the checkpoint's"),
    Flag("device", "cpu | cuda[:N] | auto"),
    Flag("prepack_weights", "multiply by a oneDNN-prepacked weight copy (CPU float32)"),
    Flag(
        "panel_gemm",
        "decode-sized matmuls on a weight copy in 16-column panels (CPU float32, AVX-512F)",
    ),
    title="engine",
)

ADMISSION = Settings(
    AdmissionConfig,
    Flag(
        "max_admitted",
        "requests admitted at once, beyond: RESOURCE_EXHAUSTED; 0 = --max-num-seqs",
    ),
    Flag(
        "max_admitted_tokens",
        "KV tokens reserved at once (prompt + max_tokens each); 0 = the whole KV pool",
    ),
    title="admission",
)


def add_instance_flags(parser: argparse.ArgumentParser, role: Role) -> None:
    main_decode = role is Role.MAIN_DECODE
    INSTANCE_REF.add(
        parser,
        instance_id=f"{role.value}-0",
        address="",
        **({"cluster": "remote"} if main_decode else {}),
    )
    INSTANCE.add(
        parser,
        kvstore_address=KVSTORE_ADDRESS,
        model=MODEL,
        **(
            {"burst_wait_ms": BURST_WAIT_MS, "burst_gap_ms": BURST_GAP_MS}
            if role in (Role.PREFILL, Role.MAIN_DECODE)
            else {}
        ),
    )
    ENGINE.add(parser)
    ADMISSION.add(parser)


def instance_config(args: argparse.Namespace, role: Role, host: str) -> InstanceConfig:
    """``add_instance_flags``' values as a config; no advertised address: ``host``:bound port."""
    ref = INSTANCE_REF.values(args)
    address = ref["address"] or f"{host}:0"
    return INSTANCE.build(
        args,
        ref=InstanceRef(ref["instance_id"], address, role, ref["cluster"]),
        engine=ENGINE.build(args),
        admission=ADMISSION.build(args),
    )
