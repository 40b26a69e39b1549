"""``pdd bench``: run a trace in one mode and write its RESULT.

Life of a run (``run_mode``):
  1. unless a gateway is given, start the mode's own stack (``modes.stack_config``:
     fresh Redis, caches and WAN emulator; logs under ``log_dir``);
  2. refuse a trace the model's vocabulary cannot take, then warm the stack up:
     one short request down each pipeline the mode uses, under its own cache
     salt (so it shares no KV with the trace) — a fresh process's first
     forward passes are several times slower and would land on the trace's
     first requests;
  3. pin the main-cluster processes (and this client) and the remote ones to
     separate CPUs (``pinning``; ``Testbed.pin_clusters``), and meter the CPU of
     each (``cpu.CpuMeter``) while ``loadgen.run_load`` replays the trace —
     greedy, ``ignore_eos``, the mode's pipeline (``modes.load_overrides``);
     this client's own CPU mask is restored afterwards;
  4. stop the stack (exit codes are kept: a service that did not exit cleanly
     is reported), then write RESULT.json and RESULT.records.jsonl beside it.

    pdd bench --trace T.jsonl --mode pdd --out pdd.json [--gateway HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from pdd.bench import metrics, modes, pinning
from pdd.bench.cpu import CpuMeter
from pdd.bench.loadgen import LoadConfig, check_vocab, run_load
from pdd.bench.mooncake import MOONCAKE_FIELDS, MooncakeConfig, load_mooncake
from pdd.bench.record import RequestResult, records_path, write_records
from pdd.bench.trace import TraceRequest, json_line, read_trace
from pdd.core.errors import UnavailableError
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.server.flags import add_client_tls_flags, auto_or_ms, client_tls_config
from pdd.server.tls import TlsConfig, open_channel
from pdd.serving.model_info import load_model_info
from pdd.testbed.stack import Stack, StackConfig, check_model

# Per-request SLO at testbed scale, on the report's TTFT (our TTFDT) only, as its SLA:
# 10 s there is ~2.8 whole-context prefills (64K tokens at ~18K tokens/s); a whole
# testbed context (~1.5K tokens) prefills in ~0.35 s idle, so 1 s here.
DEFAULT_SLO = "ttfdt_ms:1000"
CLIENT = "bench_client"
# How long a given gateway may take to accept a connection before the bench gives up on it.
CONNECT_TIMEOUT_S = 3.0


@dataclass
class ModeOutcome:
    result: dict
    records: list[RequestResult]
    # Service name → exit code after SIGTERM; empty for an external gateway.
    exit_codes: dict[str, int] = field(default_factory=dict)
    log_dir: Path | None = None

    @property
    def unclean(self) -> dict[str, int]:
        return {k: v for k, v in self.exit_codes.items() if v != 0}


WARM_UP_TOKENS = 256


async def warm_up(
    target: str,
    mode: str,
    trace: Sequence[TraceRequest],
    timeout_s: float,
    tls: TlsConfig = TlsConfig(),
) -> None:
    """One short request down each pipeline of ``mode`` (P-RLD-MD first: it warms the relay and a handoff)."""
    if not trace:
        return
    prompt = list(reversed(trace[0].prompt_token_ids[:WARM_UP_TOKENS]))
    for pipeline in ("p-rld-md", "p-md", "md") if mode == "pdd" else ("p-md",):
        req = TraceRequest(
            request_id=f"warm-up-{pipeline}-{time.time_ns():x}",
            session_id="warm-up",
            timestamp_ms=0.0,
            prompt_token_ids=prompt,
            max_tokens=16,
            expected_hit=0.0,
        )
        cfg = LoadConfig(
            target=target,
            force_pipeline=pipeline,
            cache_salt=f"warm-up-{time.time_ns():x}",
            request_timeout_s=timeout_s,
            progress=False,
            tls=tls,
        )
        rec = (await run_load([req], cfg)).records[0]
        if not rec.ok:
            raise RuntimeError(
                f"warm-up request ({pipeline}) failed: {rec.error_code} {rec.error_message}"
            )


async def wait_for_gateway(
    address: str, tls: TlsConfig = TlsConfig(), timeout_s: float = CONNECT_TIMEOUT_S
) -> None:
    """Return once ``address`` accepts a gRPC connection, else raise ``UnavailableError``: at once
    when a connection attempt fails (refused, no route, a TLS mismatch), after ``timeout_s`` when
    none completes (a host that drops packets, a server that never answers).

    NOTE: without it, a call to an unreachable host fails only after gRPC's own connect timeout
    (~20 s), and a bench would spend its warm-up and every request finding that out.
    """
    ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with open_channel(address, tls) as channel:
        state = channel.get_state(try_to_connect=True)
        while state != ready:
            if state == failed:
                raise UnavailableError(
                    f"gateway {address}: UNAVAILABLE: cannot connect (nothing listening there, or "
                    "a TLS mismatch; is `pdd up` running? --gateway HOST:PORT)"
                )
            try:
                await asyncio.wait_for(
                    channel.wait_for_state_change(state), max(0.0, deadline - loop.time())
                )
            except TimeoutError:
                raise UnavailableError(
                    f"gateway {address}: UNAVAILABLE: not reachable within {timeout_s:g} s "
                    "(is `pdd up` running there? --gateway HOST:PORT)"
                ) from None
            state = channel.get_state(try_to_connect=True)


def is_mooncake_row(row: dict) -> bool:
    """A Mooncake line (``pdd trace mooncake``'s input) rather than one of ours."""
    return "prompt_token_ids" not in row and all(k in row for k in MOONCAKE_FIELDS)


def is_mooncake_file(path: Path) -> bool:
    """Whether the file's first line is a Mooncake line (``ValueError`` when it is no JSON object)."""
    with open(path) as f:
        first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), None)
    return first is not None and is_mooncake_row(json_line(first[1], path, first[0]))


def load_trace(
    path: Path, *, mooncake: bool | None = None, block_tokens: int = 16, vocab_size: int = 0
) -> list[TraceRequest]:
    """Our trace, or a Mooncake one (``mooncake``; None: recognised by its first line's fields).

    A recognised Mooncake trace is mapped as ``pdd trace mooncake`` maps it, and said so on stderr;
    ``vocab_size`` (the served model's, when known) bounds the token ids its blocks are drawn from.
    A file that cannot be read raises ``OSError``/``ValueError`` (file, line number and field).
    """
    recognised = mooncake is None and is_mooncake_file(path)
    if mooncake or recognised:
        d = MooncakeConfig()
        cfg = MooncakeConfig(
            block_tokens=block_tokens,
            vocab_low=min(d.vocab_low, vocab_size // 2) if vocab_size else d.vocab_low,
            vocab_high=min(d.vocab_high, vocab_size) if vocab_size else d.vocab_high,
        )
        if recognised:
            print(
                f"[pdd bench] {path}: a Mooncake trace ({', '.join(MOONCAKE_FIELDS)}): mapped as "
                f"`pdd trace mooncake` maps it, {block_tokens} tokens per hash block "
                f"(--block-tokens), token ids in [{cfg.vocab_low}, {cfg.vocab_high})",
                file=sys.stderr,
            )
        trace = load_mooncake(path, cfg)
    else:
        trace = read_trace(path)
    if not trace:
        raise ValueError(f"{path}: no requests")
    return trace


async def served_vocab(target: str, tls: TlsConfig = TlsConfig()) -> int:
    """The vocabulary size the gateway at ``target`` reports (0: it does not say)."""
    async with open_channel(target, tls) as channel:
        info = await pb_grpc.GatewayServiceStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=10
        )
    return info.vocab_size


def _pids(stack: Stack | None) -> dict[str, int]:
    pids = {CLIENT: os.getpid()}
    if stack is not None:
        pids.update({p.name: p.proc.pid for p in stack.processes})
        if stack.redis is not None:
            pids["redis"] = stack.redis.pid
    return pids


def run_mode(
    trace: Sequence[TraceRequest],
    mode: str,
    out: Path,
    *,
    testbed: modes.Testbed = modes.Testbed(),
    gateway: str = "",
    log_dir: Path | None = None,
    redis_url: str = "",
    slo: str = DEFAULT_SLO,
    load: Mapping | None = None,
    config: StackConfig | None = None,
    before_stop: Callable[[Stack], None] | None = None,
) -> ModeOutcome:
    """Replay ``trace`` in ``mode``; ``load`` holds further ``LoadConfig`` fields (rps, max_requests, ...).

    ``config``: the stack to start instead of the mode's own (``modes.stack_config``), e.g. one of
    several remote clusters (``pdd.bench.clusters``); ``mode`` still says the pipelines it warms
    up and forces. ``before_stop``: called with the stack once the trace ran, before it stops
    (to scrape its /metrics).
    """
    modes.check_mode(mode)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    slo_map = metrics.parse_slo(slo)
    stack: Stack | None = None
    if not gateway:
        log_dir = log_dir or out.with_name(out.stem + "-logs")
        stack = Stack(
            config
            or modes.stack_config(
                mode,
                testbed,
                log_dir=log_dir,
                redis_url=redis_url,
                key_prefix=f"bench-{mode}-{time.time_ns():x}",
            )
        )
        stack.start()
    codes: dict[str, int] = {}
    try:
        target = gateway or stack.gateway.address
        fields = {
            "cache_salt": f"{mode}-{time.time_ns():x}",
            **(load or {}),
            **modes.load_overrides(mode),
        }
        cfg = LoadConfig(target=target, **fields)
        asyncio.run(check_vocab(target, trace, cfg.tls))
        asyncio.run(warm_up(target, mode, trace, cfg.request_timeout_s, cfg.tls))
        pids = _pids(stack)
        own_mask = pinning.allowed_cpus()
        placed = pinning.pin_processes(pids) if stack is not None and testbed.pin_clusters else {}
        try:
            meter = CpuMeter(pids, placed).start()
            run = asyncio.run(run_load(trace, cfg))
            cpu = meter.stop()
        finally:
            if placed and own_mask:
                pinning.pin(os.getpid(), own_mask)
        if before_stop is not None and stack is not None:
            before_stop(stack)
    finally:
        if stack is not None:
            codes = stack.stop()
    if stack is None:
        link = {"gateway": gateway}
    elif config is not None:
        link = modes.clusters_record(config, testbed)
    else:
        link = modes.link_record(mode, testbed)
    result = metrics.build_result(
        mode, run.records, run.duration_s, slo=slo_map, link=link, cpu=cpu
    )
    metrics.write_result(result, out)
    write_records(run.records, records_path(out))
    outcome = ModeOutcome(result, run.records, codes, log_dir if stack is not None else None)
    if outcome.unclean:
        print(
            f"[pdd bench] {mode}: services exited uncleanly {outcome.unclean}; logs in {log_dir}",
            file=sys.stderr,
        )
    return outcome


def summary_line(result: Mapping) -> str:
    def trio(key: str) -> str:
        s = result[key]
        return "/".join("-" if s[k] is None else f"{s[k]:.0f}" for k in ("p50", "p90", "p99"))

    return (
        f"{result['mode']}: {result['requests']} requests, {result['errors']} errors, "
        f"TTFT p50/p90/p99 {trio('ttft_ms')} ms, TTFDT {trio('ttfdt_ms')} ms, "
        f"pipelines {result['pipelines']}"
    )


def add_testbed_flags(p: argparse.ArgumentParser) -> None:
    d = modes.Testbed()
    g = p.add_argument_group("testbed (the stack the bench starts; ignored with --gateway)")
    g.add_argument("--model", default=d.model, help="tiny:SEED[,k=v] | smollm2 | PATH")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--kv-cache-mb", type=int, default=d.kv_cache_mb)
    g.add_argument(
        "--md-max-batched-tokens",
        type=int,
        default=d.md_max_batched_tokens,
        help="MainDecode's per-step token budget (prefill keeps the engine default)",
    )
    g.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads per engine service"
    )
    g.add_argument(
        "--wan-mbps", type=float, default=d.wan_mbps, help="WAN bandwidth of cdc-pd and pdd"
    )
    g.add_argument("--wan-delay-ms", type=float, default=d.wan_delay_ms)
    g.add_argument("--wan-jitter-ms", type=float, default=d.wan_jitter_ms)
    g.add_argument("--hit-threshold", type=float, default=d.hit_threshold)
    g.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=d.local_prefill_tokens,
        help="pdd: MainDecode prefills a predicted uncached suffix this short itself (0 = off)",
    )
    g.add_argument(
        "--relay-busy-requests",
        type=int,
        default=d.relay_busy_requests,
        help="relay load at which handoffs become one-shot",
    )
    g.add_argument(
        "--catch-up-gap",
        type=int,
        default=d.catch_up_gap,
        help="catch-up handoff ends once MainDecode is this many tokens behind",
    )
    g.add_argument(
        "--pace-max-hold-ms",
        type=float,
        default=d.pace_max_hold_ms,
        help="relay streams no faster than MainDecode during a catch-up, holding a token at most "
        "this long (0 = off)",
    )
    g.add_argument(
        "--stream-lead-ms",
        type=auto_or_ms,
        default=d.stream_lead_ms,
        help="relay's playout lead so the switch shows no stall: auto (learned) | ms | 0 = none",
    )
    g.add_argument(
        "--engine",
        choices=modes.ENGINES,
        default=d.engine,
        help="the engine of prefill, relay and MainDecode (vllm: pip install 'pdd[vllm]')",
    )
    g.add_argument(
        "--no-pin",
        dest="pin_clusters",
        action="store_false",
        help="do not pin the main and remote cluster to separate CPUs",
    )


def testbed_from(a: argparse.Namespace) -> modes.Testbed:
    """The testbed flags' ``Testbed``; its ``--model`` must name a model (``ValueError``)."""
    names = set(asdict(modes.Testbed()))
    testbed = modes.Testbed(**{k: v for k, v in vars(a).items() if k in names})
    check_model(testbed.model)  # NOTE: here, before any trace is made or any stack started
    if testbed.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        # NOTE: the stack's services run on this Python: each would fail its start alone.
        raise ValueError(
            f"engine: vllm is not importable by {sys.executable} (pip install 'pdd[vllm]', or "
            "run the vLLM venv's pdd: make vllm-venv, then .venv-vllm/bin/pdd bench ...)"
        )
    return testbed


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench [run] --trace FILE --mode idc-pd|cdc-pd|pdd --out RESULT.json [--gateway HOST:PORT]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="pdd bench run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="trace JSONL: ours (`pdd trace gen`) or Mooncake's (recognised by its fields)",
    )
    p.add_argument(
        "--mooncake", action="store_true", help="the trace is Mooncake format (else: recognised)"
    )
    p.add_argument("--block-tokens", type=int, default=16, help="Mooncake: tokens per hash block")
    p.add_argument("--mode", required=True, choices=modes.MODES)
    p.add_argument("--out", type=Path, required=True, help="RESULT.json (records go beside it)")
    p.add_argument(
        "--gateway",
        "--target",
        dest="gateway",
        default="",
        help="use this running gateway instead of starting the mode's stack",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT_S,
        help="seconds a --gateway may take to accept a connection",
    )
    p.add_argument(
        "--log-dir", type=Path, default=None, help="service logs (default: beside --out)"
    )
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument(
        "--slo", default=DEFAULT_SLO, help=f"per-request SLO of goodput (default {DEFAULT_SLO})"
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument(
        "--duration", type=float, default=None, help="issue no request after this many seconds"
    )
    p.add_argument(
        "--rps", type=float, default=None, help="re-time arrivals as Poisson at this rate"
    )
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--quiet", action="store_true")
    add_testbed_flags(p)
    add_client_tls_flags(p)
    a = p.parse_args(argv)
    try:
        testbed = testbed_from(a)
        metrics.parse_slo(a.slo)
        load = dict(
            max_requests=a.max_requests,
            max_duration_s=a.duration,
            rps=a.rps,
            time_scale=a.time_scale,
            seed=a.seed,
            request_timeout_s=a.timeout,
            progress=not a.quiet,
            tls=client_tls_config(a),
        )
        LoadConfig(target="check", **load)
        MooncakeConfig(block_tokens=a.block_tokens)
        if a.connect_timeout <= 0:
            raise ValueError(f"--connect-timeout: must be > 0, got {a.connect_timeout}")
    except ValueError as e:
        p.error(str(e))
    # NOTE: not p.error: a file's content is no usage mistake; `pdd` prints these in one line.
    mooncake = a.mooncake or is_mooncake_file(a.trace)
    if a.gateway:
        asyncio.run(wait_for_gateway(a.gateway, load["tls"], a.connect_timeout))
    vocab = 0
    if mooncake:  # its token ids are ours to draw: below the served model's vocabulary
        vocab = (
            asyncio.run(served_vocab(a.gateway, load["tls"]))
            if a.gateway
            else load_model_info(testbed.model)[0].vocab_size
        )
    trace = load_trace(
        a.trace,
        mooncake=True if a.mooncake else None,
        block_tokens=a.block_tokens,
        vocab_size=vocab,
    )
    outcome = run_mode(
        trace,
        a.mode,
        a.out,
        testbed=testbed,
        gateway=a.gateway,
        log_dir=a.log_dir,
        redis_url=a.redis_url,
        slo=a.slo,
        load=load,
    )
    print(f"{a.out}: {summary_line(outcome.result)}")
    return 1 if outcome.result["errors"] or outcome.unclean else 0


if __name__ == "__main__":
    sys.exit(main())
