"""The contenders of ``pdd bench served`` (``served``): what serves a round, and how it is timed.

- the stack (``pdd.testbed.stack``, every service its own process): ``grpc_stream`` (the
  gateway's ``Generate``, the pipeline forced) and ``http_stream`` (``/v1/completions``,
  streamed, the pipeline forced by the ``X-PDD-Pipeline`` header);
- our engine in this process: ``engine_round`` steps it until every request is done;
- vLLM's OpenAI server and the same stack on vLLM engines (``served_vllm``);
- stack B: a second stack beside the first, its services started with extra environment
  (``ServedConfig.b_env``), served by the same contenders named with ``@b`` (``grpc-p-md@b``).
  Its rounds alternate with the first stack's, so a setting is measured against the default
  through the same noise; with no extra environment it measures that noise (an A/A run).

``route`` maps each contender's name to what serves its round.

``Contenders`` starts what the chosen contenders need and says, per contender, which
processes' CPU time a round of it is charged (``pids``). Every request's timing lands in a
``RequestResult``: TTFT at its first token, the time of every token, E2EL at the end of its
stream, TPOT as vLLM's bench defines it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdd.bench.record import RequestResult
from pdd.bench.served_vllm import (
    VLLM_STACK_CONTENDERS,
    VllmServer,
    VllmStack,
    VllmStackConfig,
    children_of,
)
from pdd.server import cpus as cpu_lists
from pdd.testbed.placement import Placement

if TYPE_CHECKING:
    from pdd.bench.served_config import ServedConfig

CLIENT = "client"  # this process: the bench's own client side, not counted in a total
# NOTE: ``*-md``: the gateway routes straight to MainDecode, which prefills too (the pipeline a
# high-hit request takes): the stack's hops without disaggregation's export, push and import.
STACK_CONTENDERS = (
    "grpc-p-md",
    "http-p-md",
    "grpc-p-rld-md",
    "http-p-rld-md",
    "grpc-md",
    "http-md",
)
# A stack contender's name + this: the same contender served by stack B.
ON_B = "@b"
__all__ = ["CLIENT", "ON_B", "STACK_CONTENDERS", "VLLM_STACK_CONTENDERS", "children_of"]


@dataclass(frozen=True)
class Route:
    """What serves a contender's round: ``server`` (stack, stack-b, stack-vllm, engine, vllm),
    the door it is reached by (grpc, http, or in-process), and the pipeline the gateway is told."""

    server: str
    door: str
    pipeline: str = ""


def route(name: str) -> Route:
    """A contender's name → its route; ValueError names the field for an unknown one."""
    if name == "engine":
        return Route("engine", "in-process")
    if name == "vllm":
        return Route("vllm", "http")
    base, b, rest = name.partition(ON_B)
    if base in STACK_CONTENDERS and not rest:
        door, _, pipeline = base.partition("-")
        return Route("stack-b" if b else "stack", door, pipeline)
    if name in VLLM_STACK_CONTENDERS:
        return Route("stack-vllm", "http" if name.endswith("-http") else "grpc", "p-md")
    raise ValueError(f"contenders: unknown contender {name!r}")


def _record_latency(rec: RequestResult) -> None:
    """TPOT as vLLM's bench defines it, and the tail after the last token."""
    n = len(rec.output_token_ids)
    if rec.ttft_ms is not None and rec.e2el_ms is not None and n > 1:
        rec.tpot_ms = (rec.e2el_ms - rec.ttft_ms) / (n - 1)


async def grpc_stream(
    stub, prompt: list[int], cfg: ServedConfig, pipeline: str, salt: str, rid: str
):
    """One gateway ``Generate`` call, timed message by message (``loadgen.measure``)."""
    from pdd.bench.loadgen import PIPELINES, measure
    from pdd.gen.gateway.v1 import gateway_service_pb2 as pb

    msg = pb.GenerateRequest(
        max_tokens=cfg.output_len,
        temperature=0.0,
        ignore_eos=True,
        cache_salt=salt,
        request_id=rid,
        force_pipeline=PIPELINES[pipeline],
    )
    msg.prompt_token_ids.token_ids.extend(prompt)
    rec = RequestResult(request_id=rid, prompt_tokens=len(prompt))
    await measure(stub, msg, cfg.request_timeout_s, rec)
    return rec


async def http_stream(
    session,
    base: str,
    model: str,
    prompt: list[int],
    cfg: ServedConfig,
    headers,
    salt: str,
    rid: str,
) -> RequestResult:
    """One streamed ``/v1/completions``: server-sent events, each chunk's token ids timed."""
    import aiohttp

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if salt:
        body["cache_salt"] = salt
    rec = RequestResult(request_id=rid, prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    try:
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error_code, rec.error_message = f"HTTP {resp.status}", (await resp.text())[:300]
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                ids = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
                if ids:
                    now = (time.perf_counter() - t0) * 1000.0
                    if rec.ttft_ms is None:
                        rec.ttft_ms = now
                    rec.output_token_ids.extend(ids)
                    rec.token_times_ms.extend([now] * len(ids))
    except (OSError, ValueError, TimeoutError, aiohttp.ClientError) as exc:
        rec.error_code, rec.error_message = type(exc).__name__, str(exc)[:300]
    rec.e2el_ms = (time.perf_counter() - t0) * 1000.0
    _record_latency(rec)
    return rec


def engine_round(
    engine, prompts: list[list[int]], cfg: ServedConfig, tag: str
) -> list[RequestResult]:
    """Our engine in this process: every prompt added at once, stepped until all are done."""
    from pdd.engine import SamplingParams

    sp = SamplingParams(max_tokens=cfg.output_len, ignore_eos=True)
    recs = {
        f"{tag}-{i}": RequestResult(request_id=f"{tag}-{i}", prompt_tokens=len(p))
        for i, p in enumerate(prompts)
    }
    t0 = time.perf_counter()
    for rid, p in zip(recs, prompts):
        engine.add_request(rid, p, sp)
    left = len(recs)
    while left:
        outputs = engine.step()
        now = (time.perf_counter() - t0) * 1000.0
        for out in outputs:
            rec = recs[out.request_id]
            if out.token_id is not None:
                rec.ttft_ms = now if rec.ttft_ms is None else rec.ttft_ms
                rec.output_token_ids.append(out.token_id)
                rec.token_times_ms.append(now)
            if out.finished:
                rec.e2el_ms = now
                _record_latency(rec)
                left -= 1
    return list(recs.values())


def _stack_pids(stack) -> dict[str, list[int]]:
    """A stack's processes by name (its Redis too), whose CPU time its rounds are charged."""
    pids = {p.name: [p.proc.pid] for p in stack.processes}
    if stack.redis is not None:
        pids["redis"] = [stack.redis.pid]
    return pids


def random_model(workdir: Path) -> Path:
    """The engine benchmark's random Llama (``peer_bench``'s shape), as safetensors."""
    from pdd.engine import tiny_model

    ckpt = tiny_model(
        0,
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=10,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=4096,
        std=0.05,
    )
    return ckpt.save_hf(workdir / "model")


def _wait_ready(base: str, timeout_s: float) -> None:
    """Until the gateway's ``/ready`` says every role has registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the stack's gateway was not ready within {timeout_s:.0f} s")


def _served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


class Contenders:
    """What serves: the stack, our engine, vLLM's server; each ``round`` is one timed round."""

    def __init__(self, cfg: ServedConfig, workdir: Path) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.stack = self.stack_b = self.engine = self.vllm = self.vllm_stack = None
        self.http = self.vllm_http = None
        # Server ("stack", "stack-b", "stack-vllm") → (gRPC stub, HTTP base, served model name).
        self.doors: dict[str, tuple] = {}
        self._channels: list = []
        # Contender → process name → the pids whose CPU time a round of it is charged.
        self.pids: dict[str, dict[str, list[int]]] = {}
        # ``cfg.frontend_cpus``: fixed before this process moves its own threads.
        self.placement = Placement.keeping(cfg.frontend_cpus)

    def start(self, model_dir: Path) -> None:
        """Start what the chosen contenders need (``close`` stops whatever did start)."""
        cfg, workdir = self.cfg, self.workdir
        me = {CLIENT: [os.getpid()]}
        if any(c in STACK_CONTENDERS for c in cfg.contenders):
            self.stack = self._start_stack(model_dir)
            stack_pids = _stack_pids(self.stack)
            for c in STACK_CONTENDERS:
                self.pids[c] = {**stack_pids, **me}
        on_b = [c for c in cfg.contenders if route(c).server == "stack-b"]
        if on_b:
            self.stack_b = self._start_stack(model_dir, "b", cfg.stack_b_env())
            b_pids = _stack_pids(self.stack_b)
            for c in on_b:
                self.pids[c] = {**b_pids, **me}
        if self.placement is not None:
            # NOTE: after the stack started (it reads this process's CPUs): this process's
            # OpenMP team (our engine in-process) onto the engine CPUs, where it stays; the
            # client's thread (this one) moves to the frontend CPUs once all is started, and
            # back for the engine's own rounds (``round``).
            cpu_lists.pin(os.getpid(), self.placement.engine)
        if "engine" in cfg.contenders:
            from pdd.engine import Engine, EngineConfig
            from pdd.engine.checkpoint import load_checkpoint

            self.engine = Engine(
                load_checkpoint(model_dir), EngineConfig(max_num_seqs=max(64, *cfg.concurrency))
            )
            self.pids["engine"] = {"engine": [os.getpid()]}
        if "vllm" in cfg.contenders:
            print(
                f"starting vLLM's server ({cfg.vllm_python}); log {workdir / 'vllm.log'}",
                flush=True,
            )
            self.vllm = VllmServer(cfg, model_dir, workdir / "vllm.log", self.placement)
            api, core = self.vllm.proc.pid, [p for p in self.vllm.pids if p != self.vllm.proc.pid]
            self.pids["vllm"] = {"vllm-api": [api], "vllm-core": core, **me}
        if any(c in VLLM_STACK_CONTENDERS for c in cfg.contenders):
            print(f"starting the stack on vLLM ({cfg.vllm_python}); logs {workdir}/logs-vllm")
            self.vllm_stack = VllmStack(
                VllmStackConfig(
                    model=str(model_dir),
                    python=cfg.vllm_python,
                    log_dir=workdir / "logs-vllm",
                    threads=cfg.threads,
                    # NOTE: as vLLM's server is told; the services take no --max-model-len (theirs
                    # is the model's context), so their step budget is >= vLLM server's.
                    max_num_seqs=max(64, *cfg.concurrency),
                    startup_s=cfg.vllm_startup_s,
                )
            )
            for c in VLLM_STACK_CONTENDERS:
                self.pids[c] = {**self.vllm_stack.pids, **me}
        if self.placement is not None:
            cpu_lists.place(self.placement.frontend)

    def _start_stack(self, model_dir: Path, label: str = "", env: dict[str, str] | None = None):
        """``pdd up``'s stack on the model; ``label`` names a second one (its logs, its index)."""
        from pdd.testbed.launcher import free_port
        from pdd.testbed.stack import Stack, StackConfig

        config = StackConfig(
            model=str(model_dir),
            gateway_port=0,
            http_port=free_port(),
            metrics=False,
            engine_flags=("--threads", str(self.cfg.threads)),
            log_dir=self.workdir / (f"logs-{label}" if label else "logs"),
            key_prefix=f"served{label}{time.time_ns():x}",
            frontend_cpus=self.cfg.frontend_cpus,
            env=env or {},
        )
        extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        name = f"stack {label.upper()}" if label else "the stack"
        print(f"starting {name}{f' ({extra})' if extra else ''}; logs {config.log_dir}", flush=True)
        stack = Stack(config).start()
        try:
            _wait_ready(f"http://{stack.http_address}", 120.0)
        except BaseException:
            stack.stop()
            raise
        return stack

    async def open(self) -> None:
        import aiohttp

        from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
        from pdd.server.tls import TlsConfig, open_channel

        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        # NOTE: a new connection per request to vLLM's server: it sleeps (SIGSTOP) between its
        # rounds, and on waking closes every keep-alive connection idle past uvicorn's 5 s,
        # racing the round's first requests on them ("Server disconnected").
        self.vllm_http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout
        )
        gateways = {}
        for server, stack in (("stack", self.stack), ("stack-b", self.stack_b)):
            if stack is not None:
                gateways[server] = (stack.gateway.address, f"http://{stack.http_address}")
        if self.vllm_stack is not None:
            gateways["stack-vllm"] = (self.vllm_stack.gateway_address, self.vllm_stack.http_base)
        for server, (address, base) in gateways.items():
            cm = open_channel(address, TlsConfig())
            self._channels.append(cm)
            stub = pb_grpc.GatewayServiceStub(await cm.__aenter__())
            self.doors[server] = (stub, base, _served_model(base))

    async def aclose(self) -> None:
        if self.http is None:
            return
        await self.http.close()
        await self.vllm_http.close()
        for cm in self._channels:
            await cm.__aexit__(None, None, None)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
        if self.vllm_stack is not None:
            self.vllm_stack.close()
        for stack in (self.stack, self.stack_b):
            if stack is not None:
                stack.stop()

    def log_dir(self, name: str) -> Path | None:
        """Where the services serving ``name`` write their logs (None: not a stack)."""
        server = route(name).server
        if server == "stack" and self.stack is not None:
            return self.stack.config.log_dir
        if server == "stack-b" and self.stack_b is not None:
            return self.stack_b.config.log_dir
        if server == "stack-vllm" and self.vllm_stack is not None:
            return self.workdir / "logs-vllm"
        return None

    async def round(self, name: str, prompts: list[list[int]], tag: str) -> tuple[float, list]:
        """Serve ``prompts`` all at once on ``name``; (wall seconds, one record per prompt)."""
        cfg, how = self.cfg, route(name)
        if how.server == "engine":
            if self.placement is not None:
                cpu_lists.place(self.placement.engine)
            try:
                t = time.perf_counter()
                recs = engine_round(self.engine, prompts, cfg, tag)
                return time.perf_counter() - t, recs
            finally:
                if self.placement is not None:
                    cpu_lists.place(self.placement.frontend)
        # NOTE: ids unique per contender too: a stage may still hold a request after its stream.
        rids = [f"{tag}-{name}-{i}" for i in range(len(prompts))]
        salt = f"{tag}-{name}"
        if how.server == "vllm":
            calls = [
                http_stream(self.vllm_http, self.vllm.base, self.vllm.model, p, cfg, {}, "", r)
                for p, r in zip(prompts, rids)
            ]
        elif how.door == "grpc":
            stub = self.doors[how.server][0]
            calls = [
                grpc_stream(stub, p, cfg, how.pipeline, salt, r) for p, r in zip(prompts, rids)
            ]
        else:
            _, base, model = self.doors[how.server]
            calls = [
                http_stream(
                    self.http,
                    base,
                    model,
                    p,
                    cfg,
                    {"X-PDD-Pipeline": how.pipeline, "X-Request-Id": r},
                    salt,
                    r,
                )
                for p, r in zip(prompts, rids)
            ]
        if how.server == "vllm":
            self.vllm.resume()
        try:
            t = time.perf_counter()
            recs = await asyncio.gather(*calls)
            return time.perf_counter() - t, list(recs)
        finally:
            if how.server == "vllm":
                self.vllm.pause()
