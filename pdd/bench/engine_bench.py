"""Engine micro-benchmark against ``transformers`` on the same random Llama weights (CPU, fp32).

Measures greedy decode tokens/s at several batch sizes, prefill tokens/s of one
long prompt, and extend (``append_tokens``) of k tokens against one decode
step, and prints each next to ``transformers.generate`` on the same weights.

    .venv/bin/python -m pdd.bench.engine_bench [--threads 2] [--json out.json] [--quick]

Decode rate excludes prefill on both sides: for transformers it is
``(t(generate n) - t(generate 1)) / (n - 1)`` per batch step. "serving" is a
continuous-batching workload: 32 requests with ragged prompts and ragged
``max_tokens``, useful output tokens per second of wall time, prefill included
(transformers runs them as one left-padded ``generate`` call, as a static batch
must). Every number is the best of ``--repeats`` runs, ours and transformers
alternating, because a shared 2-core machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable

import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model


def _best_pair(
    ours: Callable[[], float],
    hf: Callable[[], float] | None,
    repeats: int,
) -> tuple[float, float | None]:
    """Best (highest) rate of each, running them alternately."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        if hf is not None:
            b.append(hf())
    return max(a), (max(b) if b else None)


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ckpt = tiny_model(
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
        self.rng = random.Random(0)
        self.engine_config = EngineConfig(
            block_size=16,
            kv_cache_bytes=args.kv_mib * 2**20,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        )
        self.hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            path = self.ckpt.save_hf(tempfile.mkdtemp(prefix="pdd_bench_"))
            self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def prompts(self, batch: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.args.vocab) for _ in range(length)] for _ in range(batch)]

    # ---- ours -------------------------------------------------------------------------
    def ours_decode(self, batch: int, prompt_len: int, new: int) -> float:
        engine = Engine(self.ckpt, self.engine_config)
        for i, p in enumerate(self.prompts(batch, prompt_len)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new))
        produced = 0
        while produced < batch:  # prefill every prompt and sample its first token
            produced += len(engine.step())
        t = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return batch * steps / (time.perf_counter() - t)

    def ours_prefill(self, length: int) -> float:
        engine = Engine(self.ckpt, self.engine_config)
        # NOTE: a fresh prompt every time, or the run is a prefix-cache hit
        return length / _timed(
            lambda: engine.generate(self.prompts(1, length), SamplingParams(max_tokens=1))
        )

    def ragged(self, n: int) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(1)
        prompts = [
            [rng.randrange(self.args.vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)
        ]
        return prompts, [rng.randint(8, 128) for _ in range(n)]

    def ours_serving(self, n: int) -> float:
        prompts, max_tokens = self.ragged(n)
        engine = Engine(self.ckpt, self.engine_config)
        params = [SamplingParams(max_tokens=m) for m in max_tokens]
        return sum(max_tokens) / _timed(lambda: engine.generate(prompts, params))

    def ours_extend(self, ks: list[int], prompt_len: int) -> dict[str, float]:
        engine = Engine(self.ckpt, self.engine_config)
        (p,) = self.prompts(1, prompt_len)
        engine.add_request("r", p, SamplingParams(max_tokens=2048))
        engine.step()
        steps = [_timed(engine.step) for _ in range(12)]
        decode = sorted(steps)[len(steps) // 2]
        out = {"decode_step_ms": decode * 1e3}
        for k in ks:
            engine.append_tokens("r", [self.rng.randrange(self.args.vocab) for _ in range(k)])
            t = _timed(engine.step)
            out[f"extend_{k}_ms"] = t * 1e3
            out[f"extend_{k}_in_decode_steps"] = t / decode
        return out

    # ---- transformers -----------------------------------------------------------------
    @torch.inference_mode()
    def hf_generate_time(self, batch: int, prompt_len: int, new: int) -> float:
        ids = torch.tensor(self.prompts(batch, prompt_len))
        return _timed(
            lambda: self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        )

    def hf_decode(self, batch: int, prompt_len: int, new: int) -> float:
        first = self.hf_generate_time(batch, prompt_len, 1)
        full = self.hf_generate_time(batch, prompt_len, new)
        return batch * (new - 1) / max(full - first, 1e-9)

    def hf_prefill(self, length: int) -> float:
        return length / self.hf_generate_time(1, length, 1)

    @torch.inference_mode()
    def hf_serving(self, n: int) -> float:
        prompts, max_tokens = self.ragged(n)
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(max_tokens)
        return sum(max_tokens) / _timed(
            lambda: self.hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--serving-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.batches, args.new_tokens, args.prefill_len = 2, "1,4", 8, 256
        args.serving_requests, args.repeats = 4, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bench = Bench(args)
    params = bench.ckpt.config.num_params
    results: dict = {
        "model": {
            "params_m": round(params / 1e6, 1),
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "threads": args.threads,
        "decode": {},
        "prefill": {},
        "serving": {},
        "extend": {},
    }
    print(f"random Llama {params / 1e6:.1f}M params, fp32, {args.threads} threads")
    print(f"{'metric':<34}{'ours':>12}{'transformers':>14}{'ratio':>8}")

    def row(name: str, ours: float, hf: float | None) -> dict:
        ratio = ours / hf if hf else None
        hf_s = f"{hf:14.1f}" if hf else f"{'-':>14}"
        print(f"{name:<34}{ours:12.1f}{hf_s}{(f'{ratio:8.2f}' if ratio else ''):>8}")
        return {"ours": ours, "transformers": hf, "ratio": ratio}

    r, hf_on = args.repeats, bench.hf is not None
    for b in [int(x) for x in args.batches.split(",")]:
        ours, hf = _best_pair(
            lambda b=b: bench.ours_decode(b, args.prompt_len, args.new_tokens),
            (lambda b=b: bench.hf_decode(b, args.prompt_len, args.new_tokens)) if hf_on else None,
            r,
        )
        results["decode"][f"batch_{b}"] = row(f"decode tok/s, batch {b}", ours, hf)
    ours, hf = _best_pair(
        lambda: bench.ours_prefill(args.prefill_len),
        (lambda: bench.hf_prefill(args.prefill_len)) if hf_on else None,
        r,
    )
    results["prefill"][f"len_{args.prefill_len}"] = row(
        f"prefill tok/s, {args.prefill_len} tokens", ours, hf
    )
    n = args.serving_requests
    ours, hf = _best_pair(
        lambda: bench.ours_serving(n), (lambda: bench.hf_serving(n)) if hf_on else None, r
    )
    results["serving"][f"ragged_{n}"] = row(f"serving tok/s, {n} ragged requests", ours, hf)
    ext = bench.ours_extend([1, 10, 100], args.prompt_len)
    results["extend"] = ext
    print(
        f"decode step (batch 1): {ext['decode_step_ms']:.1f} ms; extend(k) in decode steps: "
        + ", ".join(f"k={k}: {ext[f'extend_{k}_in_decode_steps']:.2f}" for k in (1, 10, 100))
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
