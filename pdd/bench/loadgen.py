"""Async load generator: replays a trace against a gateway and measures every stream.

Life of a run:
  1. keep the first ``max_requests`` requests (by timestamp); optionally re-time
     them as Poisson arrivals at ``rps``; group them into sessions;
  2. one task per session issues its turns in order: turn k+1 waits for its
     timestamp *and* for turn k to finish (agent semantics), and gets turn k's
     real output spliced into its prompt (the trace's placeholder design,
     ``TraceRequest.prompt_with_outputs``); no request starts after
     ``max_duration_s``;
  3. each ``Generate`` stream is timed message by message (TTFT, every ITL,
     E2EL, TPOT, the stage of each token, the handoff gap) and the final
     message's stats are copied (pipeline, handoff position, RLD/MD tokens,
     predicted vs actual MD hit, WAN bytes); a failed call keeps its gRPC code
     and message;
  4. a progress line goes to stderr; the records feed ``metrics.build_result``.
A failed turn still lets its session go on: the next turn keeps the trace's
placeholder tokens where the failed output would have been.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np

from pdd.bench import metrics
from pdd.bench.mooncake import MooncakeConfig, load_mooncake
from pdd.bench.record import RequestResult, records_path, write_records
from pdd.bench.trace import TraceRequest, poisson_arrivals_ms, read_trace
from pdd.gen.common.v1 import common_pb2
from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.server.flags import add_client_tls_flags, client_tls_config
from pdd.server.tls import TlsConfig, open_channel

PIPELINES = {
    "p-md": common_pb2.PIPELINE_P_MD,
    "p-rld-md": common_pb2.PIPELINE_P_RLD_MD,
    "md": common_pb2.PIPELINE_MD,
}
HANDOFFS = {
    "one-shot": common_pb2.HANDOFF_MODE_ONE_SHOT,
    "catch-up": common_pb2.HANDOFF_MODE_CATCH_UP,
}


def _enum_name(enum, value: int, prefix: str, sep: str = "-") -> str:
    """``PIPELINE_P_RLD_MD`` → ``p-rld-md``; the zero value → ``""``."""
    if value == 0:
        return ""
    return enum.Name(value).removeprefix(prefix).lower().replace("_", sep)


@dataclass(frozen=True)
class LoadConfig:
    target: str
    max_requests: int | None = None
    max_duration_s: float | None = None
    # Re-time arrivals as Poisson at this rate; None keeps the trace's timestamps.
    rps: float | None = None
    # Divide trace timestamps by this (2 = twice as fast).
    time_scale: float = 1.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    force_pipeline: str = ""
    handoff_mode: str = ""
    fill_outputs: bool = True
    cache_salt: str = ""
    request_timeout_s: float = 600.0
    progress: bool = True
    # The channel to the gateway: plaintext unless a CA or client certificate is given.
    tls: TlsConfig = TlsConfig()

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("target: the gateway address is required")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1, got {self.max_requests}")
        for name in ("max_duration_s", "rps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        for name in ("time_scale", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.force_pipeline and self.force_pipeline not in PIPELINES:
            raise ValueError(
                f"force_pipeline: must be one of {tuple(PIPELINES)}, got {self.force_pipeline!r}"
            )
        if self.handoff_mode and self.handoff_mode not in HANDOFFS:
            raise ValueError(
                f"handoff_mode: must be one of {tuple(HANDOFFS)}, got {self.handoff_mode!r}"
            )


@dataclass
class LoadRun:
    records: list[RequestResult]
    duration_s: float


def select(trace: Sequence[TraceRequest], cfg: LoadConfig) -> list[TraceRequest]:
    """The requests this run issues, in timestamp order, re-timed if ``cfg.rps`` is set."""
    chosen = sorted(trace, key=lambda r: r.timestamp_ms)[: cfg.max_requests]
    if cfg.rps is not None:
        times = poisson_arrivals_ms(len(chosen), cfg.rps, np.random.default_rng(cfg.seed))
        chosen = [replace(r, timestamp_ms=t) for r, t in zip(chosen, times)]
    return chosen


def build_request(req: TraceRequest, prompt: Sequence[int], cfg: LoadConfig) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        max_tokens=req.max_tokens,
        temperature=cfg.temperature,
        session_id=req.session_id,
        request_id=req.request_id,
        ignore_eos=cfg.ignore_eos,
        cache_salt=cfg.cache_salt,
        force_pipeline=PIPELINES.get(cfg.force_pipeline, 0),
        handoff_mode=HANDOFFS.get(cfg.handoff_mode, 0),
    )
    msg.prompt_token_ids.token_ids.extend(prompt)
    if cfg.temperature > 0:
        msg.seed = cfg.seed
    return msg


async def measure(
    stub: pb_grpc.GatewayServiceStub, msg: pb.GenerateRequest, timeout_s: float, rec: RequestResult
) -> RequestResult:
    """Stream one ``Generate`` call into ``rec``, timing every message."""
    t0 = time.perf_counter()
    last: float | None = None
    final: pb.GenerateResponse | None = None
    out, times, stages = rec.output_token_ids, rec.token_times_ms, rec.token_stages
    try:
        async for resp in stub.Generate(msg, timeout=timeout_s):
            now = (time.perf_counter() - t0) * 1000.0
            ids = list(resp.token_ids)[
                max(0, len(out) - resp.start_position) :
            ]  # drop re-sent positions
            if ids:
                if last is None:
                    rec.ttft_ms = now
                else:
                    rec.itl_ms.append(now - last)
                last = now
                stage = _enum_name(common_pb2.Stage, resp.stage, "STAGE_", "_")
                out.extend(ids)
                times.extend([now] * len(ids))
                stages.extend([stage] * len(ids))
            if resp.HasField("stats"):
                final = resp
    except grpc.aio.AioRpcError as e:
        rec.error_code, rec.error_message = e.code().name, e.details() or ""
    rec.e2el_ms = (time.perf_counter() - t0) * 1000.0
    if rec.ok and final is None:
        rec.error_code, rec.error_message = "UNKNOWN", "stream ended without a final message"
    if final is not None:
        _copy_stats(rec, final)
    if rec.ttft_ms is not None and len(out) > 1:
        rec.tpot_ms = (rec.e2el_ms - rec.ttft_ms) / (len(out) - 1)
    if (i := rec.handoff_index) is not None:
        rec.handoff_gap_ms = times[i] - times[i - 1]
    return rec


def _copy_stats(rec: RequestResult, final: pb.GenerateResponse) -> None:
    s = final.stats
    rec.finish_reason = _enum_name(
        common_pb2.FinishReason, final.finish_reason, "FINISH_REASON_", "_"
    )
    if rec.ok and final.finish_reason == common_pb2.FINISH_REASON_ERROR:
        rec.error_code, rec.error_message = (
            "UNKNOWN",
            "the gateway finished the stream with an error",
        )
    rec.pipeline = _enum_name(common_pb2.Pipeline, s.pipeline, "PIPELINE_")
    rec.handoff_mode = _enum_name(common_pb2.HandoffMode, s.handoff_mode, "HANDOFF_MODE_")
    rec.handoff_at_token = s.handoff_at_token
    rec.rld_tokens, rec.md_tokens = s.rld_tokens, s.md_tokens
    rec.predicted_hit = s.predicted_hit_rate
    rec.actual_hit = s.md_cached_tokens / s.prompt_tokens if s.prompt_tokens else None
    rec.wan_bytes, rec.wan_transfer_ms = s.wan_kv_bytes, s.wan_transfer_ms
    rec.server_ttft_ms = s.ttft_ms


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.sent = self.done = self.errors = 0
        self.t0 = self.shown = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.shown < (0.5 if self.tty else 5.0)):
            return
        self.shown = now
        line = (
            f"[pdd bench] {self.done}/{self.total} done, {self.sent - self.done} in flight, "
            f"{self.errors} errors, {now - self.t0:.1f} s"
        )
        print(
            ("\r" + line) if self.tty else line,
            end="\n" if force or not self.tty else "",
            file=sys.stderr,
            flush=True,
        )


async def run_load(trace: Sequence[TraceRequest], cfg: LoadConfig) -> LoadRun:
    """Issue the trace against ``cfg.target``; every issued request gets a record."""
    chosen = select(trace, cfg)
    sessions: dict[str, list[TraceRequest]] = {}
    for r in chosen:
        sessions.setdefault(r.session_id, []).append(r)
    outputs: dict[str, list[int]] = {}
    records: list[RequestResult] = []
    progress = _Progress(len(chosen), cfg.progress)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + cfg.max_duration_s if cfg.max_duration_s else None

    async def session(turns: list[TraceRequest], stub: pb_grpc.GatewayServiceStub) -> None:
        for req in turns:
            due = start + req.timestamp_ms / 1000.0 / cfg.time_scale
            if deadline is not None and max(due, loop.time()) >= deadline:
                return
            await asyncio.sleep(max(0.0, due - loop.time()))
            prompt = req.prompt_with_outputs(outputs) if cfg.fill_outputs else req.prompt_token_ids
            rec = RequestResult(
                request_id=req.request_id,
                session_id=req.session_id,
                turn=req.turn,
                start_ms=(loop.time() - start) * 1000.0,
                prompt_tokens=len(prompt),
                expected_hit=req.expected_hit,
            )
            records.append(rec)
            progress.sent += 1
            await measure(stub, build_request(req, prompt, cfg), cfg.request_timeout_s, rec)
            progress.done += 1
            progress.errors += not rec.ok
            progress.update()
            if rec.ok:
                outputs[req.request_id] = rec.output_token_ids

    async with open_channel(cfg.target, cfg.tls) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        await asyncio.gather(*(session(turns, stub) for turns in sessions.values()))
    progress.update(force=True)
    return LoadRun(records=records, duration_s=loop.time() - start)


async def check_vocab(
    target: str, trace: Sequence[TraceRequest], tls: TlsConfig = TlsConfig()
) -> None:
    """Refuse a trace whose token ids the served model cannot take (when the gateway says its vocab)."""
    try:
        async with open_channel(target, tls) as channel:
            info = await pb_grpc.GatewayServiceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), timeout=10
            )
    except grpc.aio.AioRpcError as e:
        print(
            f"[pdd bench] GetModelInfo failed ({e.code().name}); vocabulary not checked",
            file=sys.stderr,
        )
        return
    top = max((max(r.prompt_token_ids, default=0) for r in trace), default=0)
    if info.vocab_size and top >= info.vocab_size:
        raise ValueError(
            f"trace: token id {top} >= the model's vocab size {info.vocab_size}; "
            f"regenerate it with --vocab-high {info.vocab_size}"
        )


def parse_link(spec: str) -> dict:
    """``"mbps=100,delay_ms=20,name=wan"`` → ``{"mbps": 100.0, "delay_ms": 20.0, "name": "wan"}``."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"link: expected key=value, got {part!r}")
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench run --target HOST:PORT --trace FILE --mode pdd --out RESULT.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="pdd bench run", description="Replay a trace against a gateway."
    )
    p.add_argument("--target", required=True, help="gateway host:port")
    p.add_argument(
        "--trace", type=Path, required=True, help="trace JSONL (ours, or Mooncake with --mooncake)"
    )
    p.add_argument("--mooncake", action="store_true", help="the trace is Mooncake format")
    p.add_argument("--block-tokens", type=int, default=16, help="Mooncake: tokens per hash block")
    p.add_argument("--mode", required=True, help="label of this run: idc-pd | cdc-pd | pdd | ...")
    p.add_argument("--out", type=Path, required=True, help="RESULT.json (records go beside it)")
    p.add_argument("--slo", default="ttft_ms:10000,tpot_ms:200")
    p.add_argument(
        "--link", default="", help="the link settings of this run, e.g. mbps=100,delay_ms=20"
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument(
        "--duration", type=float, default=None, help="issue no request after this many seconds"
    )
    p.add_argument(
        "--rps", type=float, default=None, help="re-time arrivals as Poisson at this rate"
    )
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument(
        "--no-fill-outputs",
        dest="fill_outputs",
        action="store_false",
        help="send the trace's placeholder tokens instead of the previous turn's real output",
    )
    p.add_argument("--force-pipeline", choices=tuple(PIPELINES), default="")
    p.add_argument("--handoff-mode", choices=tuple(HANDOFFS), default="")
    p.add_argument(
        "--cache-salt", default=None, help="default: a fresh salt per run, so runs never share KV"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--quiet", action="store_true")
    add_client_tls_flags(p)
    a = p.parse_args(argv)
    try:
        cfg = LoadConfig(
            target=a.target,
            max_requests=a.max_requests,
            max_duration_s=a.duration,
            rps=a.rps,
            tls=client_tls_config(a),
            time_scale=a.time_scale,
            seed=a.seed,
            temperature=a.temperature,
            ignore_eos=a.ignore_eos,
            force_pipeline=a.force_pipeline,
            handoff_mode=a.handoff_mode,
            fill_outputs=a.fill_outputs,
            cache_salt=a.cache_salt if a.cache_salt is not None else f"{a.mode}-{time.time_ns():x}",
            request_timeout_s=a.timeout,
            progress=not a.quiet,
        )
        slo, link = metrics.parse_slo(a.slo), parse_link(a.link)
        trace = (
            load_mooncake(a.trace, MooncakeConfig(block_tokens=a.block_tokens))
            if a.mooncake
            else read_trace(a.trace)
        )
        asyncio.run(check_vocab(a.target, trace, cfg.tls))
    except ValueError as e:
        p.error(str(e))
    run = asyncio.run(run_load(trace, cfg))
    result = metrics.build_result(a.mode, run.records, run.duration_s, slo=slo, link=link)
    metrics.write_result(result, a.out)
    write_records(run.records, records_path(a.out))
    t = result["ttft_ms"]
    print(
        f"{a.out}: {result['requests']} requests, {result['errors']} errors, TTFT p50/p90/p99 "
        + "/".join("-" if t[k] is None else f"{t[k]:.0f}" for k in ("p50", "p90", "p99"))
        + " ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
