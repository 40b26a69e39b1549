"""PredictHits latency through ``PrefixStore.predict`` on a real Redis: the per-block reference
(the index as it was: every block of every instance tested) and the O(log blocks) search, side
by side in one run.

    pdd bench index [--redis-url URL] [--instances 8,64] [--prompt-tokens 65536] [--block 16]

Each instance registers and holds, by cache events, a random leading part of some of
``--prompts`` long prompts (so the searches land anywhere in the chain). Each prediction is for
one of those prompts, picked at random, hashing included, timed end to end (the registry read,
the hashing and the index lookups); reference and fast calls alternate so both see the same
noise, and every answer pair must agree. Without ``--redis-url`` a throw-away redis-server is
started (as kvstore's embedded one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from redis.asyncio import Redis

from pdd.core.block_hash import ROOT_HASH, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.prefix_index.redis_server import start_redis
from pdd.prefix_index.store import PrefixStore


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _populate(
    store: PrefixStore, n: int, prompts: list[list[int]], bs: int, rng: random.Random
) -> list[str]:
    chains = [chain_hashes(p, bs) for p in prompts]
    ids = [f"bench-{k}" for k in range(n)]
    for iid in ids:
        inst = Instance(InstanceRef(iid, "127.0.0.1:1", Role.MAIN_DECODE), bs, "bench")
        await store.register(inst, 3_600_000, reset_index=True)
        for which in rng.sample(range(len(prompts)), k=min(2, len(prompts))):
            held = rng.randint(0, len(chains[which]))
            # NOTE: in batches of 256 blocks, each chained to the last: as a radix cache emits.
            for start in range(0, held, 256):
                end = min(held, start + 256)
                parent = chains[which][start - 1] if start else ROOT_HASH
                ev = CacheEvent("stored", tuple(chains[which][start:end]), parent, "", bs)
                await store.publish(iid, [ev])
    return ids


async def _measure(args: argparse.Namespace, url: str) -> list[dict]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(150_000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    rows = []
    for n in args.instances:
        redis = Redis.from_url(url)
        store = PrefixStore(redis, f"bench{uuid.uuid4().hex[:8]}")
        try:
            ids = await _populate(store, n, prompts, args.block, rng)
            times: dict[str, list[float]] = {"reference": [], "log search": []}
            for it in range(args.iterations):
                prompt = rng.choice(prompts)
                answers = []
                modes = ["log search"]
                if it < args.reference_iterations:
                    modes.insert(it % 2, "reference")
                for mode in modes:
                    t0 = time.perf_counter()
                    hits = await store.predict(prompt, reference=mode == "reference")
                    times[mode].append((time.perf_counter() - t0) * 1e3)
                    answers.append({h.instance.ref.instance_id: h.cached_tokens for h in hits})
                if len(answers) == 2 and answers[0] != answers[1]:
                    raise AssertionError(f"reference and log search disagree at {n} instances")
            for mode, xs in times.items():
                rows.append(
                    {
                        "instances": n,
                        "mode": mode,
                        "calls": len(xs),
                        "p50_ms": round(statistics.median(xs), 2),
                        "p99_ms": round(_pct(xs, 0.99), 2),
                        "mean_ms": round(statistics.fmean(xs), 2),
                    }
                )
            await redis.delete(*(k for i in ids for k in store.registry.index_keys(i)))
            for iid in ids:
                await store.deregister(iid)
        finally:
            await redis.aclose()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pdd bench index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--redis-url", default="", help="unset: a throw-away redis-server")
    ap.add_argument("--instances", default="8,64", help="comma-separated instance counts")
    ap.add_argument("--prompt-tokens", type=int, default=65536)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4, help="distinct long prompts held")
    ap.add_argument("--iterations", type=int, default=300, help="fast predictions per count")
    ap.add_argument(
        "--reference-iterations", type=int, default=30, help="reference predictions per count"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    args.instances = [int(x) for x in args.instances.split(",") if x]
    if args.iterations < args.reference_iterations:
        ap.error("--iterations: must be >= --reference-iterations")
    proc = None
    url = args.redis_url
    if not url:
        proc, url = start_redis(Path(tempfile.mkdtemp(prefix="pdd-bench-index-")))
    try:
        rows = asyncio.run(_measure(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    blocks = args.prompt_tokens // args.block
    print(
        f"PredictHits via PrefixStore.predict: {args.prompt_tokens}-token prompt, block "
        f"{args.block} ({blocks} chained hashes), hashing included"
    )
    print(f"{'instances':>9}  {'mode':<14} {'calls':>5} {'P50 ms':>8} {'P99 ms':>8} {'mean ms':>8}")
    for r in rows:
        print(
            f"{r['instances']:>9}  {r['mode']:<14} {r['calls']:>5} {r['p50_ms']:>8.2f} "
            f"{r['p99_ms']:>8.2f} {r['mean_ms']:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
