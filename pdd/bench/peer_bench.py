"""Serving throughput of our engine next to vLLM's CPU build and ``transformers.generate``, side by side.

    make bench-vllm            # builds .venv-vllm once, then runs this with its defaults
    .venv/bin/python -m pdd.bench.peer_bench --vllm-python .venv-vllm/bin/python \
        [--concurrency 1,16,32] [--prompt-len 128] [--output-len 128] [--repeats 3] [--json out.json]

One random-weight Llama (fp32, ~64M parameters by default) is saved as a
Hugging Face directory that all three load. For each concurrency ``n`` and each
repeat, ``n`` fresh random prompts (fresh, so no prefix-cache hit anywhere) of
``--prompt-len`` tokens are served with exactly ``--output-len`` greedy output
tokens each (``ignore_eos``), all submitted at once:

- ours: ``Engine.generate`` in this process (one engine for the whole run, as a server keeps it);
- vLLM: offline ``LLM.generate`` in a long-lived ``vllm_peer`` process on the vLLM venv's python;
- transformers: one static batch ``generate`` (equal prompt lengths, so no padding).

Runs alternate ours → vLLM → transformers inside every repeat, because the
2-core machine is shared and noisy; the table shows the median and the best
output tokens/s (prefill included) and ratios of medians. The outputs are
compared too: identical token streams are evidence that every engine computes
the same model (fp32 kernels may still split a near-tie differently).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from pdd.bench.cpu import machine_cpu_s
from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")


class VllmPeer:
    """The ``vllm_peer`` process: started once, then one ``LLM.generate`` per ``run``."""

    def __init__(
        self,
        python: str,
        model_dir: Path,
        threads: int,
        max_model_len: int,
        log_path: Path,
        startup_timeout: float = 900.0,
    ):
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # NOTE: -P semantics: the script's folder (pdd/bench, whose trace.py shadows the
        # standard library's) must not go first on sys.path, here or in vLLM's spawned children.
        env["PYTHONSAFEPATH"] = "1"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [
                python,
                str(PEER_SCRIPT),
                "--model",
                str(model_dir),
                "--max-model-len",
                str(max_model_len),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._expect("PEER_READY", startup_timeout)
        self.pause()

    def _pump(self) -> None:
        """Drain the peer's stdout (vLLM logs there too) so it never blocks on a full pipe."""
        for line in self.proc.stdout:
            if line.startswith("PEER_"):
                self._lines.put(line)
            else:
                self._log.write(line)
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"vLLM peer sent no {prefix} within {timeout:.0f} s; see {self._log.name}"
            )
        if line is None or not line.startswith(prefix):
            raise RuntimeError(f"vLLM peer exited (code {self.proc.poll()}); see {self._log.name}")
        return line[len(prefix) :].strip()

    def pause(self) -> None:
        """Stop every vLLM process while the others run.

        NOTE: an idle vLLM is not idle: its worker spins for a second after each
        step and its OpenMP threads are pinned to our cores, which on a 2-core
        machine would slow whichever engine runs next.
        """
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.resume()
        try:
            return self._run(prompts, max_tokens)
        finally:
            self.pause()

    def _run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._expect("PEER_RESULT", timeout=1800))
        return result["seconds"], result["outputs"]

    def close(self) -> None:
        self.resume()
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _cpu_busy(window: float = 0.5) -> float:
    """Fraction of all CPUs busy over ``window`` seconds (0.0 where /proc/stat is missing)."""
    before = machine_cpu_s()
    time.sleep(window)
    after = machine_cpu_s()
    if before is None or after is None:
        return 0.0
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def wait_for_quiet(threshold: float, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) until other work keeps the CPUs below ``threshold`` busy.

    NOTE: on a shared 2-core machine a 2-thread engine loses badly whenever another
    process takes a core: every OpenMP region then waits for a descheduled thread.
    Runs start in quiet moments; the busy fraction seen is recorded with each run.
    """
    deadline = time.monotonic() + max_wait
    busy = _cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = _cpu_busy()
    return busy


class Ours:
    def __init__(self, ckpt, kv_bytes: int):
        self.engine = Engine(ckpt, EngineConfig(kv_cache_bytes=kv_bytes, max_num_seqs=64))

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        outputs = self.engine.generate(
            prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        return time.perf_counter() - t, outputs


class Transformers:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)  # [n, prompt_len]: equal lengths, no padding
        t = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - t, out[:, ids.shape[1] :].tolist()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--vllm-python", default=".venv-vllm/bin/python", help="python of the vLLM venv"
    )
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (ours and transformers only)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--concurrency", default="1,16,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--kv-gib", type=float, default=2.0, help="our KV pool (vLLM's VLLM_CPU_KVCACHE_SPACE=2)"
    )
    ap.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.15,
        help="start a run once the CPUs are at most this busy with other work (0..1)",
    )
    ap.add_argument(
        "--quiet-max-wait", type=float, default=120.0, help="seconds to wait for that at most"
    )
    ap.add_argument("--json", help="also write every run and the summary to this file")
    return ap.parse_args(argv)


def _summary(runs: dict[str, list[float]], tokens: int) -> dict[str, float]:
    rates = [tokens / s for s in runs]
    return {
        "median_tok_s": statistics.median(rates),
        "best_tok_s": max(rates),
        "worst_tok_s": min(rates),
    }


def _print_table(results: dict, names: list[str]) -> None:
    """Output tokens/s per engine (median and best of the repeats), ratios of medians, identical outputs."""
    others = [n for n in names if n != "ours"]
    cols = [f"{n} {k}" for n in names for k in ("med", "best")] + [f"ours/{n}" for n in others]
    widths = [max(10, len(c) + 2) for c in cols]
    print(
        f"{'conc':>5}"
        + "".join(f"{c:>{w}}" for c, w in zip(cols, widths))
        + "  same outputs as ours"
    )
    for conc, r in results.items():
        values = [r[n][f"{k}_tok_s"] for n in names for k in ("median", "best")]
        values += [r["ours"]["median_tok_s"] / r[n]["median_tok_s"] for n in others]
        same = ", ".join(f"{n} {r['same_outputs'][n]}" for n in others)
        print(
            f"{conc:>5}"
            + "".join(
                f"{v:>{w}.{2 if i >= 2 * len(names) else 1}f}"
                for i, (v, w) in enumerate(zip(values, widths))
            )
            + f"  {same}"
        )


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    # NOTE: SIGTERM must unwind through ``finally``: a paused vLLM left behind stays stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    ckpt = tiny_model(
        0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=4096,
        std=0.05,
    )
    workdir = Path(tempfile.mkdtemp(prefix="pdd_peer_"))
    model_dir = ckpt.save_hf(workdir / "model")
    params = ckpt.config.num_params / 1e6
    print(
        f"random Llama {params:.1f}M params, fp32, {args.threads} threads, prompt {args.prompt_len} + "
        f"output {args.output_len} tokens, {args.repeats} alternating repeats",
        flush=True,
    )
    engines: dict = {"ours": Ours(ckpt, int(args.kv_gib * 2**30))}
    if not args.no_vllm:
        log = workdir / "vllm.log"
        print(f"starting vLLM ({args.vllm_python}); log: {log}", flush=True)
        engines["vllm"] = VllmPeer(
            args.vllm_python, model_dir, args.threads, args.prompt_len + args.output_len + 16, log
        )
    if not args.no_hf:
        engines["transformers"] = Transformers(model_dir)
    rng = random.Random(0)
    warm = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(2)]
    for engine in engines.values():
        engine.run(warm, 4)
    results: dict = {}
    try:
        for conc in [int(c) for c in args.concurrency.split(",")]:
            times: dict[str, list[float]] = {name: [] for name in engines}
            background: dict[str, list[float]] = {name: [] for name in engines}
            same = {name: 0 for name in engines if name != "ours"}
            for rep in range(args.repeats):
                prompts = [
                    [rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(conc)
                ]
                outputs = {}
                for name, engine in engines.items():
                    busy = wait_for_quiet(args.quiet_threshold, args.quiet_max_wait)
                    seconds, outputs[name] = engine.run(prompts, args.output_len)
                    times[name].append(seconds)
                    background[name].append(round(busy, 3))
                    print(
                        f"  n={conc:<3} rep {rep} {name:<13}{conc * args.output_len / seconds:9.1f} tok/s"
                        f"   (CPUs {busy:.0%} busy before)",
                        flush=True,
                    )
                for name in same:
                    same[name] += sum(a == b for a, b in zip(outputs["ours"], outputs[name]))
            tokens = conc * args.output_len
            results[conc] = {
                name: _summary(t, tokens) | {"seconds": t, "busy_before": background[name]}
                for name, t in times.items()
            }
            results[conc]["same_outputs"] = {
                n: f"{k}/{conc * args.repeats}" for n, k in same.items()
            }
    finally:
        if "vllm" in engines:
            engines["vllm"].close()
        # NOTE: the random weights are ~250 MB a run; the logs beside them stay.
        shutil.rmtree(model_dir, ignore_errors=True)
    print()
    _print_table(results, list(engines))
    report = {
        "model": {
            "params_m": round(params, 1),
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "argv": sys.argv[1:],
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
