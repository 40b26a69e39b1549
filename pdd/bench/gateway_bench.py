"""``pdd bench gateway``: how many streamed tokens one gateway core carries.

A real engine on these cores cannot produce tokens fast enough to load a gateway core, so the
gateway is fed by the token-flood stage (``services.token_flood``: a MainDecode that streams as
fast as it can). Life of a run: Redis, kvstore, the flood stage and the gateway start as their
own processes, the gateway pinned to one CPU and everything else to the others; then, for each
``--tokens-per-message`` (the flood stage restarted with it), each way the gateway reads
MainDecode (``--streams``: one shared ``DecodeMany`` stream, or a ``Decode`` call per request;
the gateway restarted with it) and each door (gRPC ``Generate``, HTTP ``/v1/completions``
streaming), ``--concurrency`` clients each keep one request in flight
(pipeline MD forced, ``--output-len`` tokens) for ``--seconds``, checking every token's id and
position. The gateway's own CPU time over the window (``/proc``) divided by the tokens it
streamed is its CPU per token; its inverse is the tokens per second one gateway core carries,
whether or not the window saturated the core (its busy share is printed beside).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdd.bench.cpu import process_cpu_s
from pdd.bench.pinning import allowed_cpus, pin
from pdd.prefix_index.redis_server import redis_binary, start_redis
from pdd.testbed.flood_tokens import token_at
from pdd.testbed.launcher import Process, free_port, start_module

DOORS = ("grpc", "http")
# How the gateway reads MainDecode: one shared DecodeMany stream per instance (each engine step's
# tokens for every request in one message), or a Decode call per request (a message per token).
STREAMS = ("shared", "each")
TARGET_TOK_S = 50_000  # issue 19: one gateway core carries at least this many tokens/s
PROMPT = tuple(range(1, 9))


@dataclass(frozen=True)
class GatewayBenchConfig:
    concurrency: int = 64
    output_len: int = 256
    seconds: float = 10.0
    tokens_per_message: tuple[int, ...] = (1, 4, 16)
    doors: tuple[str, ...] = DOORS
    streams: tuple[str, ...] = STREAMS
    # The gateway's --model (its tokenizer detokenizes every token); a tiny random Llama's spec.
    model: str = "tiny:3,ctx=4096,layers=1,hidden=64,inter=128"
    vocab_size: int = 256
    log_dir: str = ""

    def __post_init__(self) -> None:
        for name in ("concurrency", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.seconds <= 0:
            raise ValueError(f"seconds: must be > 0, got {self.seconds}")
        if not self.tokens_per_message or min(self.tokens_per_message) < 1:
            raise ValueError(
                f"tokens_per_message: each must be >= 1, got {self.tokens_per_message}"
            )
        bad = [d for d in self.doors if d not in DOORS]
        if not self.doors or bad:
            raise ValueError(f"doors: choose from {', '.join(DOORS)}, got {','.join(self.doors)}")
        bad = [d for d in self.streams if d not in STREAMS]
        if not self.streams or bad:
            raise ValueError(
                f"streams: choose from {', '.join(STREAMS)}, got {','.join(self.streams)}"
            )


@dataclass
class Window:
    """One measured window: one door, one message size."""

    door: str
    tokens_per_message: int
    streams: str = "shared"
    tokens: int = 0
    messages: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    gateway_cpu_s: float = 0.0

    @property
    def cpu_us_per_token(self) -> float | None:
        return self.gateway_cpu_s / self.tokens * 1e6 if self.tokens else None

    @property
    def tokens_per_core_s(self) -> float | None:
        return self.tokens / self.gateway_cpu_s if self.gateway_cpu_s > 0 else None

    @property
    def busy(self) -> float:
        return self.gateway_cpu_s / self.wall_s if self.wall_s else 0.0


def check_tokens(start: int, ids: Sequence[int], vocab: int) -> str | None:
    """What is wrong with a message's tokens (the flood's are a function of position)."""
    want = [token_at(p, vocab) for p in range(start, start + len(ids))]
    return None if list(ids) == want else f"tokens at {start}: got {list(ids)[:4]}, want {want[:4]}"


class Bench:
    """The processes of a run; ``window`` measures one door at the current message size."""

    def __init__(self, cfg: GatewayBenchConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdd-gateway-bench-"))
        self.procs: list[Process] = []
        self.redis = None
        self.flood: Process | None = None
        self.gateway: Process | None = None
        self.kvstore = ""
        self.http_port = free_port()
        cpus = sorted(allowed_cpus())
        # NOTE: the gateway alone on the last CPU; the load (flood, clients, kvstore) elsewhere.
        self.gateway_cpus = {cpus[-1]} if len(cpus) > 1 else set(cpus)
        self.other_cpus = set(cpus[:-1]) or set(cpus)

    def start(self) -> None:
        self.redis, url = start_redis(self.log_dir, redis_binary())
        kv = self._start("kvstore", "services.kvstore", ["--redis-url", url])
        self.kvstore = kv.address

    def gateway_with(self, streams: str) -> None:
        """(Re)start the gateway reading MainDecode as ``streams`` says."""
        if self.gateway is not None:
            self.gateway.stop()
            self.procs.remove(self.gateway)
        args = ["--kvstore", self.kvstore, "--model", self.cfg.model]
        args += ["--http-port", str(self.http_port)]
        # NOTE: the bench measures the cost of a streamed token, not admission: every client in.
        args += ["--no-adaptive-in-flight", "--max-in-flight", str(self.cfg.concurrency)]
        args += ["--shared-decode-stream" if streams == "shared" else "--no-shared-decode-stream"]
        self.gateway = self._start(
            f"gateway-{streams}", "services.gateway", args, self.gateway_cpus
        )

    def _start(
        self, name: str, module: str, args: list[str], cpus: set[int] | None = None
    ) -> Process:
        p = start_module(name, module, ["--port", "0", *args], log_dir=self.log_dir)
        self.procs.append(p)
        pin(p.proc.pid, cpus or self.other_cpus)
        return p

    def flood_with(self, tokens_per_message: int) -> None:
        if self.flood is not None:
            self.flood.stop()
            self.procs.remove(self.flood)
        self.flood = self._start(
            f"token_flood-{tokens_per_message}",
            "services.token_flood",
            [
                "--kvstore",
                self.kvstore,
                "--instance-id",
                f"token-flood-{tokens_per_message}",
                "--tokens-per-message",
                str(tokens_per_message),
                "--vocab-size",
                str(self.cfg.vocab_size),
            ],
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)


async def _grpc_client(bench: Bench, w: Window, until: float) -> None:
    import grpc

    from pdd.bench.loadgen import PIPELINES
    from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
    from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    assert bench.gateway is not None
    cfg = bench.cfg
    async with grpc.aio.insecure_channel(bench.gateway.address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        while time.perf_counter() < until:
            msg = pb.GenerateRequest(
                max_tokens=cfg.output_len, ignore_eos=True, force_pipeline=PIPELINES["md"]
            )
            msg.prompt_token_ids.token_ids.extend(PROMPT)
            got = 0
            try:
                async for resp in stub.Generate(msg, timeout=60):
                    if resp.token_ids:
                        if bad := check_tokens(resp.start_position, resp.token_ids, cfg.vocab_size):
                            w.errors.append(bad)
                        got += len(resp.token_ids)
                        w.messages += 1
            except grpc.aio.AioRpcError as exc:
                w.errors.append(f"{exc.code().name}: {exc.details()}"[:200])
            w.tokens += got
            w.requests += 1
            if got != cfg.output_len:
                w.errors.append(f"a request streamed {got} of {cfg.output_len} tokens")


async def _http_client(bench: Bench, w: Window, until: float) -> None:
    import aiohttp

    cfg = bench.cfg
    body = {
        "model": cfg.model,
        "prompt": list(PROMPT),
        "max_tokens": cfg.output_len,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    url = f"http://127.0.0.1:{bench.http_port}/v1/completions"
    headers = {"X-PDD-Pipeline": "md"}
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() < until:
            got = 0
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    w.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    w.requests += 1
                    continue
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    ids = [
                        t
                        for c in json.loads(line[5:]).get("choices", [])
                        for t in c.get("token_ids") or []
                    ]
                    if ids:
                        if (bad := check_tokens(got, ids, cfg.vocab_size)) is not None:
                            w.errors.append(bad)
                        got += len(ids)
                        w.messages += 1
            w.tokens += got
            w.requests += 1
            if got != cfg.output_len:
                w.errors.append(f"a request streamed {got} of {cfg.output_len} tokens")


async def window(bench: Bench, door: str, tokens_per_message: int, streams: str) -> Window:
    """``concurrency`` clients for ``seconds``; the gateway's CPU over exactly that window."""
    assert bench.gateway is not None
    w = Window(door, tokens_per_message, streams)
    client = _grpc_client if door == "grpc" else _http_client
    pid = bench.gateway.proc.pid
    cpu0, t0 = process_cpu_s(pid), time.perf_counter()
    until = t0 + bench.cfg.seconds
    await asyncio.gather(*(client(bench, w, until) for _ in range(bench.cfg.concurrency)))
    cpu1, t1 = process_cpu_s(pid), time.perf_counter()
    w.wall_s = t1 - t0
    w.gateway_cpu_s = (cpu1 or 0.0) - (cpu0 or 0.0)
    return w


def table(windows: Sequence[Window]) -> list[str]:
    lines = [
        f"{'door':5} {'streams':7} {'tok/msg':>7} {'tokens':>8} {'tok/s':>8} {'gw busy':>7} "
        f"{'gw µs/tok':>9} {'tok/s per gw core':>17} {'x target':>8} errors"
    ]
    for w in windows:
        per_core = w.tokens_per_core_s
        lines.append(
            f"{w.door:5} {w.streams:7} {w.tokens_per_message:>7} {w.tokens:>8} "
            f"{w.tokens / w.wall_s:>8.0f} "
            f"{w.busy:>7.0%} {w.cpu_us_per_token or 0:>9.1f} {per_core or 0:>17.0f} "
            f"{(per_core or 0) / TARGET_TOK_S:>8.2f} {len(w.errors)}"
        )
    return lines


async def run(cfg: GatewayBenchConfig) -> list[Window]:
    bench = Bench(cfg)
    own_mask = allowed_cpus()
    await asyncio.to_thread(bench.start)
    pin(os.getpid(), bench.other_cpus)  # NOTE: the clients stay off the gateway's CPU
    windows: list[Window] = []
    try:
        for k in cfg.tokens_per_message:
            await asyncio.to_thread(bench.flood_with, k)
            for streams in cfg.streams:  # NOTE: side by side, on the same flood stage
                await asyncio.to_thread(bench.gateway_with, streams)
                for door in cfg.doors:
                    # NOTE: warm-up (connections, caches): not counted
                    await window(bench, door, k, streams)
                    w = await window(bench, door, k, streams)
                    print(table([w])[-1], flush=True)
                    windows.append(w)
    finally:
        await asyncio.to_thread(bench.stop)
        if own_mask:  # NOTE: the caller (a test, the CLI in-process) gets its CPUs back
            pin(os.getpid(), own_mask)
    return windows


def main(argv: Sequence[str] | None = None) -> int:
    d = GatewayBenchConfig()
    ap = argparse.ArgumentParser(prog="pdd bench gateway", description=__doc__)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--seconds", type=float, default=d.seconds)
    ap.add_argument("--tokens-per-message", default=",".join(map(str, d.tokens_per_message)))
    ap.add_argument("--doors", default=",".join(d.doors))
    ap.add_argument(
        "--streams",
        default=",".join(d.streams),
        help="how the gateway reads MainDecode: shared (one DecodeMany stream), each (a Decode "
        "call per request)",
    )
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--json", type=Path, help="also write every window here")
    args = ap.parse_args(argv)
    try:
        per_message = tuple(int(x) for x in args.tokens_per_message.split(",") if x)
    except ValueError:
        ap.error(f"--tokens-per-message: a comma list of integers, got {args.tokens_per_message!r}")
    try:
        cfg = GatewayBenchConfig(
            concurrency=args.concurrency,
            output_len=args.output_len,
            seconds=args.seconds,
            tokens_per_message=per_message,
            doors=tuple(x for x in args.doors.split(",") if x),
            streams=tuple(x for x in args.streams.split(",") if x),
            model=args.model,
        )
    except ValueError as exc:
        ap.error(str(exc))
    print(
        f"gateway bench: {cfg.concurrency} clients, {cfg.output_len} tokens each, "
        f"{cfg.seconds:g} s a window",
        flush=True,
    )
    print(table([])[0], flush=True)
    windows = asyncio.run(run(cfg))
    if args.json:
        rows = [{**w.__dict__, "tokens_per_core_s": w.tokens_per_core_s} for w in windows]
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(w.errors for w in windows) else 0
