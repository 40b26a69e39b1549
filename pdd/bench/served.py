"""Served throughput: ``pdd up``'s stack against our engine in-process and vLLM's OpenAI server.

    make bench-served          # builds .venv-vllm once (make vllm-venv), then runs this
    pdd bench served [--concurrency 1,16,32,64] [--contenders grpc-p-md,http-p-md,engine,vllm]
        (PDD on vLLM: --contenders stack-vllm,vllm; make bench-served-vllm)
        [--prompt-len 128] [--output-len 64] [--rounds 3] [--model HF_DIR] [--json out.json]

One model for everyone: ``--model`` (a Hugging Face directory) or, by default, the engine
benchmark's random Llama (~64M parameters, fp32, std 0.05) written once as safetensors.

Life of a run: the stack (``pdd.testbed.stack``, every service its own process, the WAN
emulator in front of MainDecode) and ``vllm serve`` (from ``.venv-vllm``) start once; then for
each concurrency ``n`` and each round, every contender in turn serves ``n`` fresh prompts
submitted at once, streaming, greedy, exactly ``--output-len`` tokens each (``ignore_eos``):

- ``grpc-p-md`` / ``grpc-p-rld-md``: the gateway's ``Generate`` with the pipeline forced;
- ``http-p-md`` / ``http-p-rld-md``: the gateway's ``/v1/completions`` (``stream: true``), the
  pipeline forced by the ``X-PDD-Pipeline`` header;
- ``grpc-md`` / ``http-md``: the same, pipeline MD (MainDecode prefills too, as for a high-hit
  request): the stack's hops without disaggregation's KV export, push and import;
- ``engine``: our engine in this process, stepped until every request is done (no hops at all);
- ``vllm``: vLLM's ``/v1/completions``, streaming, token-id prompts;
- ``stack-vllm`` / ``stack-vllm-http``: the same stack with ``--engine vllm`` (no relay), run on
  the vLLM venv's Python (``served_vllm``), P-MD forced, by gRPC / HTTP (not by default);
- ``grpc-p-md@b`` (any stack contender + ``@b``): the same on stack B, a second stack whose
  services get ``--b-env NAME=VALUE`` too — a setting against the default through the same
  noise, printed as B / A round by round (``served_ab``) — or run another checkout's code
  (``--b-code DIR``: another commit against this one); without either, an A/A run.

Contenders alternate round by round, so a noisy moment on the shared machine hits all alike;
the ratios within one run are the figures to read (``served_overhead`` prints them against
vLLM's server: throughput, TTFT, TPOT, CPU per token; ``served_budget`` where a round's time
goes — TTFT, handoff, decode per token, tail, and the hops the stack's services log — against
the round the 1.2× target allows; ``served_ceiling`` the throughput each contender's CPU a
token allows on these cores). A round's number is output tokens / wall
time (prefill included). Beside it: TTFT and TPOT P50, the P50 of the time from a request's
last token to the end of its stream (``tail``: what the client waits for after the last token),
and the CPU seconds each process spent per output token, from its own ``/proc/<pid>/stat``
(utime + stime, children included for vLLM's engine core) before and after the round.
vLLM's processes are SIGSTOPped while the others run (an idle vLLM spins: ``peer_bench``).

Fresh prompts (``FreshPrompts``): a counter in the first two tokens makes every prompt's first
KV block new, so no prefix cache anywhere can hit; the stack also gets a cache salt per
contender, because its gRPC and HTTP contenders (and both pipelines) share one stack.

The contenders themselves live in ``served_contenders``; ``--py-spy`` profiles the stack's
processes over the measured rounds (``py_spy``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

from pdd.bench.cpu import process_cpu_s
from pdd.bench.metrics import percentile
from pdd.bench.py_spy import PySpy
from pdd.bench.record import RequestResult
from pdd.bench.served_ab import ab_table
from pdd.bench.served_budget import budget_table, logged_hops, request_hops
from pdd.bench.served_ceiling import ceiling_table, cpu_totals
from pdd.bench.served_config import (
    CONTENDERS,
    PROFILED,
    REFERENCE,
    ServedConfig,
)
from pdd.bench.served_contenders import CLIENT, ON_B, Contenders, random_model
from pdd.bench.served_overhead import emulator_table, overhead_table
from pdd.server import cpus as cpu_lists


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None


class FreshPrompts:
    """Prompts no server has seen before: prompt ``k`` starts with ``k`` in base ``vocab``.

    NOTE: two tokens of counter give every prompt a first KV block of its own (a block hash
    chains from the first token on), so no prefix cache can hit one, whatever its block size;
    the rest is random. ``vocab ** 2`` prompts before the counter would wrap: refused.
    """

    def __init__(self, vocab: int, length: int, seed: int = 0) -> None:
        if vocab < 2 or length < 2:
            raise ValueError(f"vocab and length: must be >= 2, got {vocab}, {length}")
        self.vocab, self.length = vocab, length
        self._rng = random.Random(seed)
        self._next = 0

    def take(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            k = self._next
            if k >= self.vocab**2:
                raise ValueError(f"FreshPrompts: more than {self.vocab**2} prompts")
            self._next += 1
            rest = [self._rng.randrange(self.vocab) for _ in range(self.length - 2)]
            out.append([k % self.vocab, k // self.vocab, *rest])
        return out


# ---- CPU accounting ----------------------------------------------------------------------
def cpu_snapshot(pids: Mapping[str, Sequence[int]]) -> dict[str, float | None]:
    """Name → CPU seconds (user + system) its processes have used; None if none could be read."""
    out: dict[str, float | None] = {}
    for name, group in pids.items():
        values = [v for v in (process_cpu_s(p) for p in group) if v is not None]
        out[name] = sum(values) if values else None
    return out


def cpu_delta(
    before: Mapping[str, float | None], after: Mapping[str, float | None]
) -> dict[str, float | None]:
    """CPU seconds each process spent between two snapshots (None where either is missing)."""
    return {
        name: None
        if before.get(name) is None or after[name] is None
        else after[name] - before[name]
        for name in after
    }


# ---- the numbers --------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    contender: str
    concurrency: int
    wall_s: float
    output_tokens: int
    errors: int
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    tail_ms: tuple[float, ...]
    cpu_s: Mapping[str, float | None]
    # first → second token, and the decode interval per token after it (``served_budget``)
    handoff_ms: tuple[float, ...] = ()
    decode_ms: tuple[float, ...] = ()

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def summarize(rounds: Sequence[Round]) -> dict:
    """One contender at one concurrency: median/best tok/s, latency P50s, CPU ms per token."""
    tokens = sum(r.output_tokens for r in rounds)
    cpu: dict[str, float | None] = {}
    for r in rounds:
        for name, s in r.cpu_s.items():
            cpu[name] = None if s is None or cpu.get(name, 0.0) is None else cpu.get(name, 0.0) + s

    def p50(field: str) -> float | None:
        return percentile([v for r in rounds for v in getattr(r, field)], 50)

    known = [s for n, s in cpu.items() if s is not None and n != CLIENT]
    wall = sum(r.wall_s for r in rounds)
    return {
        "median_tok_s": statistics.median(r.tok_s for r in rounds),
        "mean_tok_s": tokens / wall if wall > 0 else None,  # the ceiling's measure
        "best_tok_s": max(r.tok_s for r in rounds),
        "errors": sum(r.errors for r in rounds),
        "ttft_p50_ms": p50("ttft_ms"),
        "tpot_p50_ms": p50("tpot_ms"),
        "tail_p50_ms": p50("tail_ms"),
        "handoff_p50_ms": p50("handoff_ms"),
        "decode_p50_ms": p50("decode_ms"),
        "cpu_ms_per_token": {
            n: None if s is None or not tokens else 1000.0 * s / tokens for n, s in cpu.items()
        },
        "cpu_ms_per_token_total": 1000.0 * sum(known) / tokens if known and tokens else None,
        # every process, the client included, and the cores they kept busy (``served_ceiling``)
        **cpu_totals(cpu, wall, tokens),
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(results: Mapping[int, Mapping[str, dict]]) -> list[str]:
    """The printed table: one line per concurrency and contender, ratios to vLLM's median."""
    head = (
        f"{'conc':>4} {'contender':<16}{'tok/s med':>10}{'best':>8}{'x vLLM':>8}"
        f"{'TTFT p50':>10}{'TPOT p50':>10}{'tail p50':>10}{'CPU ms/tok':>11}"
        f"{'same outputs':>19}  CPU ms/tok per process"
    )
    lines = [head]
    for conc, by_name in results.items():
        ref = by_name.get(REFERENCE, {}).get("median_tok_s")
        for name, s in by_name.items():
            per = " ".join(
                f"{n}={_fmt(v, 2)}"
                for n, v in s["cpu_ms_per_token"].items()
                if v is None or v >= 0.005
            )
            lines.append(
                f"{conc:>4} {name:<16}{s['median_tok_s']:>10.1f}{s['best_tok_s']:>8.1f}"
                f"{_fmt(ratio(s['median_tok_s'], ref), 2):>8}{_fmt(s['ttft_p50_ms']):>10}"
                f"{_fmt(s['tpot_p50_ms']):>10}{_fmt(s['tail_p50_ms']):>10}"
                f"{_fmt(s['cpu_ms_per_token_total'], 2):>11}"
                f"{s.get('same_outputs_as', '-'):>19}  {per}"
                + (f"  ERRORS {s['errors']}" if s["errors"] else "")
            )
    return lines


def make_round(
    contender: str, conc: int, wall_s: float, recs: Sequence[RequestResult], cpu_s, output_len: int
) -> Round:
    ok = [r for r in recs if r.ok and len(r.output_token_ids) == output_len]
    hops = [request_hops(r) for r in ok]
    return Round(
        contender,
        conc,
        wall_s,
        sum(len(r.output_token_ids) for r in recs if r.ok),
        len(recs) - len(ok),
        tuple(r.ttft_ms for r in ok if r.ttft_ms is not None),
        tuple(r.tpot_ms for r in ok if r.tpot_ms is not None),
        tuple(r.e2el_ms - r.token_times_ms[-1] for r in ok if r.token_times_ms and r.e2el_ms),
        dict(cpu_s),
        tuple(h for h, _ in hops if h is not None),
        tuple(d for _, d in hops if d is not None),
    )


# ---- the run ------------------------------------------------------------------------------
def _reference(names: Sequence[str]) -> str:
    """Whose outputs the others' are compared with: vLLM's, else our engine's, else the first."""
    return next((n for n in (REFERENCE, "engine") if n in names), names[0])


def _same(a: Sequence[RequestResult], b: Sequence[RequestResult]) -> int:
    return sum(x.ok and y.ok and x.output_token_ids == y.output_token_ids for x, y in zip(a, b))


async def run(cfg: ServedConfig, workdir: Path) -> dict:
    from pdd.bench.peer_bench import wait_for_quiet

    # NOTE: before anything is placed: the CPUs every contender shares (``served_ceiling``).
    cores = len(cpu_lists.allowed())
    model_dir = Path(cfg.model) if cfg.model else random_model(workdir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    fresh = FreshPrompts(vocab, cfg.prompt_len, seed=0)
    contenders = Contenders(cfg, workdir)
    results: dict[int, dict[str, dict]] = {}
    rounds: list[dict] = []
    spy: PySpy | None = None
    profile: dict = {}
    try:
        contenders.start(model_dir)
        await contenders.open()
        names = list(cfg.contenders)
        for name in names:  # warm-up: first calls pay for connections, compiles, allocations
            await contenders.round(name, fresh.take(2), f"warm-{name}")
        if cfg.py_spy:
            stack_pids = contenders.pids[next(c for c in names if c in PROFILED)]
            spy = PySpy(
                cfg.py_spy, {n: g for n, g in stack_pids.items() if n != CLIENT}, workdir / "py-spy"
            )
        for conc in cfg.concurrency:
            done: dict[str, list[Round]] = {n: [] for n in names}
            same = {n: 0 for n in names}
            request_ids: dict[str, list[str]] = {n: [] for n in names}
            for k in range(cfg.rounds):
                prompts = fresh.take(conc)
                outputs = {}
                order = names[k % len(names) :] + names[: k % len(names)]  # none always first
                for name in order:
                    busy = wait_for_quiet(cfg.quiet_threshold, cfg.quiet_max_wait_s)
                    pids = contenders.pids[name]
                    before = cpu_snapshot(pids)
                    wall, recs = await contenders.round(name, prompts, f"n{conc}r{k}")
                    cpu_s = cpu_delta(before, cpu_snapshot(pids))
                    r = make_round(name, conc, wall, recs, cpu_s, cfg.output_len)
                    done[name].append(r)
                    outputs[name] = recs
                    request_ids[name] += [x.request_id for x in recs]
                    rounds.append(asdict(r) | {"busy_before": round(busy, 3)})
                    first_error = next((x.error_message for x in recs if not x.ok), "")
                    print(
                        f"  n={conc:<3} round {k} {name:<16}{r.tok_s:9.1f} tok/s  "
                        f"(CPUs {busy:.0%} busy before)"
                        + (f"  {r.errors} errors: {first_error}" if r.errors else ""),
                        flush=True,
                    )
                ref = _reference(names)
                for name in names:
                    same[name] += _same(outputs[ref], outputs[name])
            results[conc] = {n: summarize(done[n]) for n in names}
            ref = _reference(names)
            for n in names:
                results[conc][n]["same_outputs_as"] = f"{ref} {same[n]}/{conc * cfg.rounds}"
                if (log_dir := contenders.log_dir(n)) is not None:
                    results[conc][n]["logged_hops"] = logged_hops(log_dir, request_ids[n])
    finally:
        if spy is not None:
            profile = spy.stop()
        await contenders.aclose()
        contenders.close()
    return {
        "config": asdict(cfg),
        "model": str(model_dir),
        "results": results,
        "cores": cores,
        "rounds": rounds,
        "profile": profile,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # NOTE: the defaults, not a default config: that one would already check for vLLM's venv.
    d = SimpleNamespace(**{f.name: f.default for f in fields(ServedConfig)})
    ap = argparse.ArgumentParser(
        prog="pdd bench served",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--concurrency", default=",".join(map(str, d.concurrency)))
    ap.add_argument(
        "--contenders", default=",".join(d.contenders), help=f"any of {','.join(CONTENDERS)}"
    )
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len)
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument(
        "--model", default=d.model, help="a Hugging Face directory (default: a random Llama)"
    )
    ap.add_argument("--vllm-python", default=d.vllm_python)
    ap.add_argument(
        "--vllm-serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag of vLLM's server, e.g. --vllm-serve-flag=--distributed-executor-backend=uni",
    )
    ap.add_argument("--quiet-threshold", type=float, default=d.quiet_threshold)
    ap.add_argument("--quiet-max-wait", type=float, default=d.quiet_max_wait_s)
    ap.add_argument("--py-spy", default=d.py_spy, help="a py-spy binary: profile the stack")
    ap.add_argument(
        "--frontend-cpus",
        type=int,
        default=d.frontend_cpus,
        metavar="N",
        help="keep the last N CPUs for every contender's frontends and the client, the engines "
        "on the rest (pdd up --frontend-cpus; vLLM's OpenMP bound there too)",
    )
    ap.add_argument(
        "--b-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="start stack B, a second stack whose services get this environment too "
        f"(repeatable), for the contenders named with {ON_B} (grpc-p-md{ON_B}): a setting "
        "against the default, rounds alternating",
    )
    ap.add_argument(
        "--b-code",
        default=d.b_code,
        metavar="DIR",
        help="stack B runs the code of this checkout (git worktree add DIR COMMIT): another "
        f"commit against this one, for the contenders named with {ON_B}",
    )
    ap.add_argument("--json", type=Path, help="also write every round and the summary here")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> ServedConfig:
    return ServedConfig(
        concurrency=_int_list(args.concurrency, "concurrency"),
        contenders=tuple(c.strip() for c in args.contenders.split(",") if c.strip()),
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rounds=args.rounds,
        threads=args.threads,
        model=args.model,
        vllm_python=args.vllm_python,
        vllm_serve_flags=tuple(args.vllm_serve_flag),
        quiet_threshold=args.quiet_threshold,
        quiet_max_wait_s=args.quiet_max_wait,
        py_spy=args.py_spy,
        frontend_cpus=args.frontend_cpus,
        b_env=tuple(_env_pair(text) for text in args.b_env),
        b_code=args.b_code,
    )


def _env_pair(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq:
        raise ValueError(f"b_env: expected NAME=VALUE, got {text!r}")
    return key, value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    try:
        cfg = config_from(args)
    except ValueError as exc:
        print(f"pdd bench served: error: {exc}", file=sys.stderr)
        return 2
    # NOTE: SIGTERM must unwind through ``finally``: a paused vLLM left behind stays stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(cfg.threads)
    workdir = Path(tempfile.mkdtemp(prefix="pdd_served_"))
    print(
        f"served bench: prompt {cfg.prompt_len} + output {cfg.output_len} tokens, "
        f"{cfg.rounds} alternating rounds, {cfg.threads} threads; work dir {workdir}",
        flush=True,
    )
    try:
        report = asyncio.run(run(cfg, workdir))
    finally:
        # NOTE: the random weights are ~250 MB a run; logs and profiles stay.
        shutil.rmtree(workdir / "model", ignore_errors=True)
    print()
    for line in table(report["results"]):
        print(line)
    for extra in (
        overhead_table(report["results"]),
        emulator_table(report["results"]),
        ceiling_table(report["results"], report["cores"]),
        budget_table(report["results"], cfg.output_len),
        ab_table(report["rounds"], tuple(cfg.stack_b_env().items())),
    ):
        if extra:
            print("", *extra, sep="\n")
    for name, top in report["profile"].items():
        print(f"\n{name}: self / inclusive share of its py-spy samples")
        for frame, own, incl in top:
            print(f"  {own:6.1%} {incl:6.1%}  {frame}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
