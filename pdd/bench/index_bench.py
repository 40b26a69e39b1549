"""PredictHits latency on a real Redis, measured four ways side by side in one run, and where the
time goes.

    pdd bench index [--redis-url URL] [--instances 8,64] [--prompt-tokens 65536] [--block 16]

Each instance registers and holds, by cache events, a random leading part of some of
``--prompts`` long prompts (so the searches land anywhere in the chain). First the reference
predicts the prompts in turn, ``--reference-iterations`` times (on its own: its calls are slow and
leave Redis and the collector busy, which is no part of the other modes' latency); then each
iteration predicts one of the prompts, picked at random, hashing included, once per other mode
(their order rotating, so all see the same noise):

  ``reference``  ``PrefixStore.predict(reference=True)``: the per-block count (every block of every
                 instance tested);
  ``store``      ``PrefixStore.predict`` on the tokens as kvstore's converter hands them over;
  ``proto``      what kvstore's servicer does: request message (the token ids packed: hashing
                 included) → ``predict`` → response message;
  ``grpc``       what the gateway does: ``InstanceView.predict`` on the prompt as a request holds
                 it (a tuple of ints) → ``KvstoreClient``: the prompt hashed at the known
                 instances' block size, a ``PredictHits`` call to kvstore running as its own
                 process, the answer converted back (``--no-grpc``: not).

Every answer must equal the others of its iteration and the reference's for its prompt. The
``store`` calls also say where their time went (``PredictCost``): hashing, listing the registry, the
Lua call's round trip and, of it, the time inside Redis (``INFO commandstats``, a mean), and the
bench process's own CPU time (the rest of a call's wall time is waiting: for Redis, or for a CPU);
the ``grpc`` row, kvstore's CPU time per call (``/proc``); and every count, how busy all CPUs were
meanwhile (ours and anything else on the host: on a shared machine, the tail's cause). The same
prompts come back unchanged, so the runs kvstore remembers are right (the best case for
``live_predict.RunMemory``); ``--no-guesses`` measures the search without them.
Without ``--redis-url`` a throw-away redis-server is started (as kvstore's embedded one).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from redis.asyncio import Redis

from pdd.bench.cpu import machine_cpu_s, process_cpu_s
from pdd.core.block_hash import ROOT_HASH, chain_hashes
from pdd.core.cache_event import CacheEvent
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.prefix_index.live_predict import PredictCost
from pdd.prefix_index.redis_server import start_redis
from pdd.prefix_index.store import PrefixStore
from pdd.serving.instance_view import InstanceView
from pdd.testbed.launcher import Process, start_module
from pdd.wire import kvstore as conv
from pdd.wire.kvstore_client import KvstoreClient

MODES = ("reference", "store", "proto", "grpc")
PHASES = ("hashing", "registry", "index", "in_redis", "own_cpu")


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


async def _script_stats(redis: Redis) -> tuple[int, int]:
    """(EVALSHA calls, their microseconds inside Redis) so far."""
    st = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    return int(st.get("calls", 0)), int(st.get("usec", 0))


def _kvstore(url: str, prefix: str) -> Process:
    args = ["--port", "0", "--redis-url", url, "--key-prefix", prefix, "--log-level", "warning"]
    return start_module("kvstore", "services.kvstore", args)


async def _measure_count(
    args: argparse.Namespace, url: str, n: int, prompts: list[list[int]], rng: random.Random
) -> list[dict[str, Any]]:
    redis = Redis.from_url(url)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    store = PrefixStore(redis, prefix, guesses=args.guesses)
    kvstore: Process | None = None
    channel: grpc.aio.Channel | None = None
    try:
        ids = await _populate(store, n, prompts, args.block, rng)
        # NOTE: what is alive now is out of the collector's way, as in every service (bootstrap).
        gc.freeze()
        # The tokens as each door hands them over: a message for kvstore, its converted form.
        msgs = [conv.predict_to_pb(p) for p in prompts]
        tokens = [conv.predict_from_pb(m)["prompt"] for m in msgs]
        held = [tuple(p) for p in prompts]  # NOTE: as a GenerateJob holds its prompt
        modes = [m for m in MODES if m != "grpc" or args.grpc]
        if args.grpc:
            kvstore = _kvstore(url, prefix)
            channel = grpc.aio.insecure_channel(kvstore.address)
            client = KvstoreClient(channel, timeout_s=10)
            view = InstanceView(lambda: client)
        times: dict[str, list[float]] = {m: [] for m in modes}
        phases: dict[str, list[float]] = {p: [] for p in PHASES}
        refreshes = 0
        guessed: list[float] = []

        async def run(mode: str, which: int) -> dict[str, int]:
            nonlocal refreshes
            if mode == "reference":
                hits = await store.predict(prompts[which], reference=True)
            elif mode == "store":
                cost, cpu0 = PredictCost(), time.process_time()
                hits = await store.predict(tokens[which], cost=cost)
                phases["own_cpu"].append(time.process_time() - cpu0)
                phases["hashing"].append(cost.hashing)
                phases["registry"].append(cost.registry)
                phases["index"].append(cost.index)
                refreshes += cost.refreshes
                guessed.append(cost.guessed / n)
            elif mode == "proto":
                hits = await store.predict(**conv.predict_from_pb(msgs[which]))
                resp = pb.PredictHitsResponse(hits=[conv.hit_to_pb(h) for h in hits])
                return {h.instance.ref.instance_id: h.cached_tokens for h in resp.hits}
            else:
                hits = await view.predict(held[which])
            return {h.instance.ref.instance_id: h.cached_tokens for h in hits}

        # NOTE: the first call lists the registry (both kvstores'), and tells the gateway's view
        # the instances (their block size): not what is measured.
        await run("store", 0)
        if args.grpc:
            await run("grpc", 0)
        for xs in (*phases.values(), guessed):
            xs.clear()
        refreshes = 0
        # NOTE: the reference on its own, first. Each of its calls (~0.5 s at 64 instances) leaves
        # a busy Redis and much garbage behind; interleaved with the fast modes it put its wake
        # into their tails (at 64 instances, gRPC P99 ~7 ms where without it ~5). Nothing
        # changes the index meanwhile, so its answer for a prompt holds for every later call.
        expected: dict[int, str] = {}
        for it in range(args.reference_iterations if "reference" in modes else 0):
            which = it % len(prompts)
            t0 = time.perf_counter()
            expected[which] = json.dumps(await run("reference", which), sort_keys=True)
            times["reference"].append((time.perf_counter() - t0) * 1e3)
        gc.collect()
        fast = [m for m in modes if m != "reference"]
        calls0, usec0 = await _script_stats(redis)
        machine0 = machine_cpu_s()
        kv0 = process_cpu_s(kvstore.proc.pid) if kvstore is not None else None
        for it in range(args.iterations):
            which = rng.randrange(len(prompts))
            now = fast[it % len(fast) :] + fast[: it % len(fast)]
            answers = {}
            for mode in now:
                t0 = time.perf_counter()
                answers[mode] = json.dumps(await run(mode, which), sort_keys=True)
                times[mode].append((time.perf_counter() - t0) * 1e3)
            if len({*answers.values(), expected.get(which, answers[now[0]])}) != 1:
                raise AssertionError(
                    f"the modes disagree at {n} instances: {answers}, reference "
                    f"{expected.get(which)}"
                )
        calls1, usec1 = await _script_stats(redis)
        machine1 = machine_cpu_s()
        kv1 = process_cpu_s(kvstore.proc.pid) if kvstore is not None else None
        fast_calls = sum(len(times[m]) for m in modes if m != "reference")
        # NOTE: every fast mode runs the same script once per call (the view held: no refresh).
        in_redis = (usec1 - usec0) / max(1, calls1 - calls0) / 1e3
        rows = []
        for mode, xs in times.items():
            row = {
                "instances": n,
                "mode": mode,
                "calls": len(xs),
                "p50_ms": round(statistics.median(xs), 2),
                "p90_ms": round(_pct(xs, 0.90), 2),
                "p99_ms": round(_pct(xs, 0.99), 2),
                "mean_ms": round(statistics.fmean(xs), 2),
            }
            if machine0 is not None and machine1 is not None:
                busy, total = (b - a for a, b in zip(machine0, machine1))
                row["machine_busy"] = round(busy / max(total, 1e-9), 2)
            if mode == "grpc" and kv0 is not None and kv1 is not None:
                row["kvstore_cpu_ms"] = round((kv1 - kv0) / len(xs) * 1e3, 2)
            if mode == "store":
                for p in PHASES:
                    ms = in_redis if p == "in_redis" else statistics.fmean(phases[p]) * 1e3
                    row[f"{p}_ms"] = round(ms, 3)
                row["refreshes"] = refreshes
                row["guessed_share"] = round(statistics.fmean(guessed), 3)
                row["script_calls_per_call"] = round((calls1 - calls0) / max(1, fast_calls), 2)
            rows.append(row)
        await redis.delete(*(k for i in ids for k in store.registry.index_keys(i)))
        for iid in ids:
            await store.deregister(iid)
        return rows
    finally:
        gc.unfreeze()
        if channel is not None:
            await channel.close()
        if kvstore is not None:
            kvstore.stop()
        await redis.aclose()


async def _measure(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(150_000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    rows = []
    for n in args.instances:
        rows += await _measure_count(args, url, n, prompts, rng)
    return rows


def _print(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    blocks = args.prompt_tokens // args.block
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"PredictHits: {args.prompt_tokens}-token prompt, block {args.block} ({blocks} chained "
        f"hashes), hashing included; load average {load}, {os.cpu_count()} CPUs"
    )
    head = f"{'instances':>9}  {'mode':<10} {'calls':>5}"
    print(head + "".join(f"{h:>9}" for h in ("P50 ms", "P90 ms", "P99 ms", "mean ms")))
    for r in rows:
        cells = "".join(f"{r[k]:>9.2f}" for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms"))
        extra = f"   kvstore CPU {r['kvstore_cpu_ms']:.2f} ms/call" if "kvstore_cpu_ms" in r else ""
        print(f"{r['instances']:>9}  {r['mode']:<10} {r['calls']:>5}{cells}{extra}")
    busy = {r["instances"]: r["machine_busy"] for r in rows if "machine_busy" in r}
    if busy:
        shares = ", ".join(f"{n} instances {b:.0%}" for n, b in busy.items())
        print(f"all CPUs busy while measuring (ours and anything else): {shares}")
    print(
        "where a store call's time goes (means, ms): hashing, registry (listing it again), index "
        "(the Lua call's round trip), in Redis (of it), own CPU (the rest of wall: waiting)"
    )
    print(f"{'instances':>9}" + "".join(f"{p:>10}" for p in (*PHASES, "total")))
    for r in rows:
        if r["mode"] == "store":
            cells = "".join(f"{r[p + '_ms']:>10.3f}" for p in PHASES)
            print(f"{r['instances']:>9}{cells}{r['mean_ms']:>10.3f}")


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
    ap.add_argument("--iterations", type=int, default=300, help="predictions per count and mode")
    ap.add_argument(
        "--reference-iterations", type=int, default=30, help="reference predictions per count"
    )
    ap.add_argument(
        "--grpc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also call PredictHits on kvstore as its own process",
    )
    ap.add_argument(
        "--guesses",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="searches start from remembered runs, as kvstore's do (--no-guesses: not; no grpc)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    args.instances = [int(x) for x in args.instances.split(",") if x]
    args.grpc = args.grpc and args.guesses  # NOTE: kvstore, as a service, always guesses
    if min(args.iterations, args.reference_iterations) < 1:
        ap.error("--iterations, --reference-iterations: must be at least 1")
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
    _print(args, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
