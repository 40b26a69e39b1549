"""Accuracy parity: lm-evaluation-harness through PDD's OpenAI API, once per pipeline (``make eval``).

Life of a run: the tokenizer lm-eval needs is written from the model's GGUF (``tokenizer/``) →
one stack (prefill, relay, MainDecode, each its own process) serves the API → lm-eval's
``local-completions`` model runs the task set in ``eval/tasks`` (a loglikelihood multiple-choice
task: echo + prompt logprobs; a generate-until task: greedy text) with every request forced
onto P-MD, then P-RLD-MD one-shot, then P-RLD-MD catch-up (``X-PDD-Pipeline`` /
``X-PDD-Handoff-Mode``; the gateway's own counters confirm where they went) → the stack stops
and the same API is served over one in-process engine (``EngineGateway``) for the reference run →
the table (task, metric, one column per run) is printed and written with the raw results; the
run fails unless every column is identical (greedy).

lm-eval lives in its own venv (``.venv-eval``, its pins must not move the project's packages)
that also sees the project's: ``make eval`` runs this module with that venv's Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "eval" / "tasks"
TASKS = ("pdd_arith_mc", "pdd_sequence_gen")
MODEL = "smollm2"


@dataclass(frozen=True)
class Mode:
    """One run: its column name and the router overrides its requests carry ("" = none)."""

    name: str
    pipeline: str = ""
    handoff: str = ""

    def headers(self) -> dict[str, str]:
        out = {}
        if self.pipeline:
            out["X-PDD-Pipeline"] = self.pipeline
        if self.handoff:
            out["X-PDD-Handoff-Mode"] = self.handoff
        return out


STACK_MODES = (
    Mode("P-MD", "p-md"),
    Mode("P-RLD-MD one-shot", "p-rld-md", "one-shot"),
    Mode("P-RLD-MD catch-up", "p-rld-md", "catch-up"),
)
IN_PROCESS = Mode("in-process engine")


def write_tokenizer(out: Path) -> Path:
    """The model's tokenizer as a Hugging Face directory (lm-eval tokenizes its requests)."""
    from transformers import AutoTokenizer

    from pdd.engine.model_source import smollm2_gguf_path

    path = out / "tokenizer"
    if not (path / "tokenizer.json").exists():
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(path))
    return path


def lm_eval_run(
    base_url: str, tokenizer: Path, mode: Mode, limit: int | None, batch_size: int
) -> dict[str, dict[str, float]]:
    """lm-eval's ``local-completions`` on ``TASKS`` → {task: {metric: value}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{base_url}/v1/completions",
            "model": MODEL,
            "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": batch_size,
            "num_concurrent": 1,
            "max_retries": 1,
            "timeout": 600,
            "header": mode.headers(),
        },
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=limit,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return scores(results["results"])


def scores(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """lm-eval's per-task results → {task: {metric: value}} (metrics only, no stderr)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in sorted(results.items()):
        out[task] = {
            key.split(",")[0] + ("" if key.endswith(",none") else f" ({key.split(',')[1]})"): v
            for key, v in sorted(values.items())
            if "," in key and "_stderr" not in key and isinstance(v, (int, float))
        }
    return out


def table(columns: dict[str, dict[str, dict[str, float]]], routed: dict[str, str]) -> str:
    """The parity table in Markdown: one row per (task, metric), one column per run."""
    names = list(columns)
    rows = sorted({(t, m) for col in columns.values() for t, ms in col.items() for m in ms})
    lines = [
        "| task | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for task, metric in rows:
        cells = [f"{columns[n].get(task, {}).get(metric, float('nan')):.4f}" for n in names]
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    if routed:
        lines.append(
            "| requests | routed as | " + " | ".join(routed.get(n, "") for n in names) + " |"
        )
    return "\n".join(lines)


def identical(columns: dict[str, dict[str, dict[str, float]]]) -> bool:
    values = list(columns.values())
    return all(v == values[0] for v in values[1:])


def routed_counts(metrics_address: str) -> dict[str, float]:
    """The gateway's ``pdd_requests_total`` by pipeline (what its router actually did)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == "pdd_requests_total":
                pipeline = s.labels.get("pipeline", "")
                counts[pipeline] = counts.get(pipeline, 0.0) + s.value
    return counts


def _delta(before: dict[str, float], after: dict[str, float]) -> str:
    moved = {p: after.get(p, 0) - before.get(p, 0) for p in after}
    return ", ".join(f"{int(v)} {p}" for p, v in sorted(moved.items()) if v)


def run_stack(
    tokenizer: Path, limit: int | None, batch_size: int, log_dir: Path
) -> tuple[dict[str, dict], dict[str, str]]:
    from pdd.testbed.launcher import free_port
    from pdd.testbed.stack import Stack, StackConfig

    config = StackConfig(
        model=MODEL,
        gateway_port=0,
        http_port=free_port(),
        engine_flags=("--kv-cache-mb", "192", "--threads", "1"),
        gateway_flags=("--seed", "0"),
        log_dir=log_dir,
        key_prefix=f"eval{int(time.time())}",
    )
    columns, routed = {}, {}
    stack = Stack(config).start()
    try:
        base = f"http://{stack.http_address}"
        for mode in STACK_MODES:
            before = routed_counts(stack.metrics["gateway"])
            t0 = time.perf_counter()
            columns[mode.name] = lm_eval_run(base, tokenizer, mode, limit, batch_size)
            routed[mode.name] = _delta(before, routed_counts(stack.metrics["gateway"]))
            print(f"{mode.name}: {time.perf_counter() - t0:.0f} s, {routed[mode.name]}", flush=True)
    finally:
        codes = stack.stop()
    if any(codes.values()):
        raise RuntimeError(f"the stack exited uncleanly: {codes}")
    return columns, routed


def run_in_process(tokenizer: Path, limit: int | None, batch_size: int) -> dict[str, dict]:
    """The reference: the same API over one in-process engine, lm-eval in a thread beside it."""
    from pdd.bench.engine_gateway import EngineGateway
    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.http.config import HttpConfig
    from pdd.http.openai_api import OpenAIServer
    from pdd.serving.model_info import load_model_info
    from pdd.serving.model_spec import load_model

    info, decode = load_model_info(MODEL)
    engine = Engine(load_model(MODEL), EngineConfig(kv_cache_bytes=192 * 2**20))

    async def serve(work: Callable[[str], dict]) -> dict:
        gateway = EngineGateway(engine)
        await gateway.start()
        server = OpenAIServer(gateway, info, decode, HttpConfig(port=0, served_model_name=MODEL))
        await server.start()
        try:
            base = f"http://127.0.0.1:{server.port}"
            return await asyncio.get_running_loop().run_in_executor(None, work, base)
        finally:
            await server.stop()
            await gateway.stop()

    return asyncio.run(
        serve(lambda base: lm_eval_run(base, tokenizer, IN_PROCESS, limit, batch_size))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eval_parity", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "pdd-eval")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per API request")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(a.out)
    t0 = time.perf_counter()
    columns, routed = run_stack(tokenizer, a.limit, a.batch_size, a.out / "logs")
    columns[IN_PROCESS.name] = run_in_process(tokenizer, a.limit, a.batch_size)
    routed[IN_PROCESS.name] = "one engine"
    text = table(columns, routed)
    same = identical(columns)
    verdict = "identical in every run" if same else "NOT identical: see the columns"
    report = f"{text}\n\nScores {verdict} ({time.perf_counter() - t0:.0f} s).\n"
    print(report)
    (a.out / "table.md").write_text(report)
    (a.out / "results.json").write_text(
        json.dumps({"scores": columns, "routed": routed, "identical": same}, indent=2)
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
