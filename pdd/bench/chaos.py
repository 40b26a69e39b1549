"""``pdd chaos``: inject real faults into a running stack and measure what the clients saw.

Life of a run:
  1. start one supervised Stack (``restart="on-failure"``: what is killed comes back): a tiny
     random model, two MainDecodes (each behind its own WAN emulator, with a one-way delay so
     requests stay in flight), two prefills, one relay, its own Redis;
  2. a fault-free reference run of the fixed request list for each pipeline the chosen faults
     force (greedy and seeded sampling alike: draws depend only on seed and position);
  3. for each fault: the same requests, issued one every ``interval_s``; the fault is injected
     the first moment its condition holds (``MOMENTS``: at least ``in_flight`` requests in
     flight and the victim mid-request, asked with DescribeCache(request_id)); a probe loop
     times the recovery; once every request ended (each has a deadline) and the stack is
     whole again, a short drain, then each engine instance's DescribeCache;
  4. the table (``FaultRow``) is printed and written as chaos.json + chaos.md into ``--out``.
Exit status: 1 if any row is not clean (a failed request, a lost/duplicated/changed token, an
output unlike the reference, a request still holding KV), else 0.

The measurement (``check_stream``, ``fault_row``) is pure: recorded streams in, numbers out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from pdd.gen.common.v1 import common_pb2
from pdd.gen.gateway.v1 import gateway_service_pb2 as gw_pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as gw_grpc
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as md_pb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.prefill.v1 import prefill_service_pb2 as p_pb
from pdd.gen.prefill.v1 import prefill_service_pb2_grpc as p_grpc
from pdd.gen.relay.v1 import relay_service_pb2 as r_pb
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc
from pdd.testbed.stack import LinkSettings, Stack, StackConfig

# Fault → the pipeline its requests are forced onto ("" = the router's choice).
FAULTS = {
    "main_decode": "p-md",
    "main_decode_relayed": "p-rld-md",
    "prefill": "p-md",
    "relay": "p-rld-md",
    "kvstore": "",
    "redis": "",
    "wan_partition": "p-md",
}
PIPELINES = {
    "": 0,
    "p-md": common_pb2.PIPELINE_P_MD,
    "p-rld-md": common_pb2.PIPELINE_P_RLD_MD,
}
# When each fault is injected (the README's table repeats it).
MOMENTS = {
    "main_decode": ">= N in flight; SIGKILL the MainDecode holding the KV of most of those that "
    "streamed a token",
    "main_decode_relayed": ">= N in flight; SIGKILL the MainDecode most of those the relay "
    "streams are bound for, before their handoff (the WAN delay holds their KV back)",
    "prefill": ">= N in flight; SIGKILL the prefill holding an in-flight request's KV",
    "relay": ">= N in flight; SIGKILL the relay once it holds one that streamed a token (not yet "
    "handed off)",
    "kvstore": ">= N in flight",
    "redis": ">= N in flight",
    "wan_partition": ">= N in flight; SIGSTOP the WAN emulator in front of the MainDecode "
    "holding the KV of most of those that streamed a token, SIGCONT after partition_s",
}
SEEDED_TEMPERATURE = 0.8
TINY = "tiny:7,ctx=512"
BLOCK = 4


# --- the measurement (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class StreamCheck:
    """One request's stream, position by position."""

    # The output, each position's first receipt, up to the first missing position.
    tokens: tuple[int, ...]
    # Positions never received below the stream's expected length.
    lost: int
    # Receipts beyond the first of a position (a repeated position).
    duplicated: int
    # Repeated positions whose token differed from the first receipt.
    conflicting: int


def check_stream(chunks: Sequence[tuple[int, Sequence[int]]], expected: int | None) -> StreamCheck:
    """``chunks``: each message's (start_position, token_ids), in arrival order. ``expected``:
    how many tokens the stream should hold (a completed request's max_tokens); None: the
    highest received position bounds it (a failed request: its tail is not "lost")."""
    seen: dict[int, int] = {}
    duplicated = conflicting = 0
    for start, ids in chunks:
        if start < 0:
            raise ValueError(f"chunks: negative start_position {start}")
        for offset, tok in enumerate(ids):
            pos = start + offset
            if pos in seen:
                duplicated += 1
                conflicting += seen[pos] != tok
            else:
                seen[pos] = tok
    length = expected if expected is not None else (max(seen) + 1 if seen else 0)
    lost = sum(1 for pos in range(length) if pos not in seen)
    tokens = []
    for pos in range(length):
        if pos not in seen:
            break
        tokens.append(seen[pos])
    return StreamCheck(tuple(tokens), lost, duplicated, conflicting)


@dataclass
class StreamRecord:
    """What one request's client saw."""

    index: int
    request_id: str
    seeded: bool
    max_tokens: int
    chunks: list[tuple[int, list[int]]] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float | None = None
    # "OK" or the gRPC status code's name.
    status: str = ""
    message: str = ""
    main_decode_instance: str = ""
    migrations: int = 0

    @property
    def streamed(self) -> int:
        return sum(len(ids) for _, ids in self.chunks)

    def in_flight(self, at_s: float) -> bool:
        return self.start_s <= at_s and (self.end_s is None or self.end_s > at_s)


@dataclass(frozen=True)
class FaultRow:
    fault: str
    pipeline: str
    moment: str
    injected: bool
    in_flight: int
    requests: int
    completed: int
    failed: int
    # gRPC status name → how many requests failed with it.
    statuses: dict[str, int]
    lost: int
    duplicated: int
    conflicting: int
    identical_greedy: int
    greedy: int
    identical_seeded: int
    seeded: int
    # Requests (failed ones too) whose received tokens differ from the reference's.
    changed: int
    migrated: int
    recover_s: float | None
    # Σ kv_blocks_used over the engine instances: idle before the fault, after the drain.
    kv_blocks_before: int
    kv_blocks_after: int
    # (instance, request) pairs whose DescribeCache(request_id) still says it holds KV.
    requests_holding_kv: int

    def __post_init__(self) -> None:
        if self.completed + self.failed != self.requests:
            raise ValueError(
                f"completed: {self.completed} + failed {self.failed} != requests {self.requests}"
            )

    @property
    def clean(self) -> bool:
        return (
            self.injected
            and self.failed == 0
            and self.lost == self.duplicated == self.changed == 0
            and self.identical_greedy == self.greedy
            and self.identical_seeded == self.seeded
            and self.requests_holding_kv == 0
        )


def fault_row(
    fault: str,
    records: Sequence[StreamRecord],
    reference: dict[int, Sequence[int]],
    *,
    pipeline: str = "",
    injected_at_s: float | None = None,
    recover_s: float | None = None,
    kv_blocks_before: int = 0,
    kv_blocks_after: int = 0,
    requests_holding_kv: int = 0,
) -> FaultRow:
    """The table's row for one fault from what the clients recorded (``reference``: request
    index → the fault-free output)."""
    statuses: dict[str, int] = {}
    lost = duplicated = conflicting = changed = migrated = 0
    identical = {True: 0, False: 0}
    counts = {True: 0, False: 0}
    completed = 0
    for rec in records:
        ok = rec.status == "OK"
        check = check_stream(rec.chunks, rec.max_tokens if ok else None)
        lost += check.lost
        duplicated += check.duplicated
        conflicting += check.conflicting
        migrated += rec.migrations > 0
        ref = list(reference.get(rec.index, ()))
        got = list(check.tokens)
        changed += got != ref[: len(got)] or check.conflicting > 0
        counts[rec.seeded] += 1
        if ok:
            completed += 1
            identical[rec.seeded] += got == ref and check.lost == 0
        else:
            statuses[rec.status] = statuses.get(rec.status, 0) + 1
    in_flight = (
        sum(rec.in_flight(injected_at_s) for rec in records) if injected_at_s is not None else 0
    )
    return FaultRow(
        fault=fault,
        pipeline=pipeline or "routed",
        moment=MOMENTS.get(fault, ""),
        injected=injected_at_s is not None,
        in_flight=in_flight,
        requests=len(records),
        completed=completed,
        failed=len(records) - completed,
        statuses=dict(sorted(statuses.items())),
        lost=lost,
        duplicated=duplicated,
        conflicting=conflicting,
        identical_greedy=identical[False],
        greedy=counts[False],
        identical_seeded=identical[True],
        seeded=counts[True],
        changed=changed,
        migrated=migrated,
        recover_s=recover_s,
        kv_blocks_before=kv_blocks_before,
        kv_blocks_after=kv_blocks_after,
        requests_holding_kv=requests_holding_kv,
    )


HEADER = (
    "| fault | pipeline | in flight | completed | failed (status) | lost | dup | "
    "identical greedy | identical seeded | migrated | recover s | KV blocks idle → after | "
    "requests holding KV |"
)


def markdown_table(rows: Sequence[FaultRow]) -> str:
    lines = [HEADER, "|" + "---|" * 13]
    for r in rows:
        failed = str(r.failed)
        if r.statuses:
            failed += " (" + ", ".join(f"{k} {v}" for k, v in r.statuses.items()) + ")"
        recover = f"{r.recover_s:.2f}" if r.recover_s is not None else "never"
        fault = r.fault if r.injected else f"{r.fault} (not injected)"
        lines.append(
            f"| {fault} | {r.pipeline} | {r.in_flight} | {r.completed}/{r.requests} | {failed} | "
            f"{r.lost} | {r.duplicated} | {r.identical_greedy}/{r.greedy} | "
            f"{r.identical_seeded}/{r.seeded} | {r.migrated} | {recover} | "
            f"{r.kv_blocks_before} → {r.kv_blocks_after} | {r.requests_holding_kv} |"
        )
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosConfig:
    out: Path = Path("pdd-chaos")
    faults: tuple[str, ...] = tuple(FAULTS)
    requests: int = 16
    # Seconds between two requests' starts.
    interval_s: float = 0.15
    # Inject once at least this many requests are in flight.
    in_flight: int = 4
    min_tokens: int = 96
    max_tokens: int = 160
    seed: int = 0
    wan_delay_ms: float = 200.0
    partition_s: float = 3.0
    # Every request's deadline (a hang ends as DEADLINE_EXCEEDED).
    request_timeout_s: float = 60.0
    # The gateway's longest wait for a stage.
    stage_timeout_s: float = 20.0
    # How long recovery is probed before it is reported as "never".
    recover_timeout_s: float = 90.0
    drain_s: float = 2.0
    model: str = TINY

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown or not self.faults:
            raise ValueError(f"faults: choose from {', '.join(FAULTS)}, got {list(self.faults)}")
        for name in ("requests", "in_flight", "min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens: must be >= min_tokens ({self.min_tokens})")
        if self.in_flight > self.requests:
            raise ValueError(f"in_flight: must be <= requests ({self.requests})")
        for name in (
            "interval_s",
            "partition_s",
            "request_timeout_s",
            "stage_timeout_s",
            "recover_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("wan_delay_ms", "drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ChaosRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    # None: greedy.
    seed: int | None


def chaos_requests(cfg: ChaosConfig) -> list[ChaosRequest]:
    """The fixed request list: every other one greedy, the rest sampled with their own seed."""
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.requests):
        prompt = tuple(rng.randrange(1, 256) for _ in range(rng.randrange(32, 200)))
        n = rng.randrange(cfg.min_tokens, cfg.max_tokens + 1)
        out.append(ChaosRequest(i, prompt, n, None if i % 2 == 0 else 1000 + i))
    return out


def stack_config(cfg: ChaosConfig) -> StackConfig:
    return StackConfig(
        model=cfg.model,
        gateway_port=0,
        metrics=False,
        prefill=2,
        relay=1,
        main_decode=2,
        wan=LinkSettings(delay_ms=cfg.wan_delay_ms),
        engine_flags=(
            "--block-size",
            str(BLOCK),
            "--kv-cache-mb",
            "32",
            "--threads",
            "1",
            "--lease-ttl-ms",
            "3000",
        ),
        gateway_flags=("--seed", "0", "--stage-timeout-s", str(cfg.stage_timeout_s)),
        log_dir=cfg.out / "logs",
        key_prefix=f"chaos{uuid.uuid4().hex[:8]}",
        restart="on-failure",
    )


def _message(req: ChaosRequest, rid: str, salt: str, pipeline: str) -> gw_pb.GenerateRequest:
    msg = gw_pb.GenerateRequest(
        max_tokens=req.max_tokens,
        temperature=0.0 if req.seed is None else SEEDED_TEMPERATURE,
        ignore_eos=True,
        cache_salt=salt,
        request_id=rid,
        force_pipeline=PIPELINES[pipeline],
    )
    if pipeline == "p-rld-md":
        # NOTE: one-shot, so the relay keeps the request until MainDecode's KV is ready.
        msg.handoff_mode = common_pb2.HANDOFF_MODE_ONE_SHOT
    msg.prompt_token_ids.token_ids.extend(req.prompt)
    if req.seed is not None:
        msg.seed = req.seed
    return msg


async def _stream(
    stub: gw_grpc.GatewayServiceStub, msg: gw_pb.GenerateRequest, rec: StreamRecord, timeout: float
) -> StreamRecord:
    rec.start_s = time.monotonic()
    final = None
    try:
        async for resp in stub.Generate(msg, timeout=timeout):
            if resp.token_ids:
                rec.chunks.append((resp.start_position, list(resp.token_ids)))
            if resp.HasField("stats"):
                final = resp
        if final is None:
            rec.status, rec.message = "UNKNOWN", "stream ended without a final message"
        elif final.finish_reason == common_pb2.FINISH_REASON_ERROR:
            rec.status, rec.message = "UNKNOWN", "finished with FINISH_REASON_ERROR"
        else:
            rec.status = "OK"
    except grpc.aio.AioRpcError as exc:
        rec.status, rec.message = exc.code().name, (exc.details() or "")[:300]
    rec.end_s = time.monotonic()
    if final is not None:
        rec.main_decode_instance = final.stats.main_decode_instance
        rec.migrations = final.stats.migrations
    return rec


@dataclass
class EngineProbe:
    """DescribeCache on every engine instance, by its own address (never through the WAN)."""

    stack: Stack

    def _targets(self):
        for p in self.stack.processes:
            kind = p.name.split("-")[0]
            stub, req = {
                "prefill": (p_grpc.PrefillServiceStub, p_pb.DescribeCacheRequest),
                "relay": (r_grpc.RelayServiceStub, r_pb.DescribeCacheRequest),
                "main_decode": (md_grpc.MainDecodeServiceStub, md_pb.DescribeCacheRequest),
            }.get(kind, (None, None))
            if stub is not None and p.address:
                yield p.name, p.address, stub, req

    async def holding(self, request_ids: Sequence[str], prefix: str = "") -> dict[str, list[str]]:
        """Instance name → the request ids (of ``request_ids``) whose KV it holds."""
        out: dict[str, list[str]] = {}
        for name, address, stub, req in self._targets():
            if not name.startswith(prefix):
                continue
            async with grpc.aio.insecure_channel(address) as ch:
                s = stub(ch)
                held = []
                for rid in request_ids:
                    try:
                        r = await s.DescribeCache(req(request_id=rid), timeout=2)
                    except grpc.aio.AioRpcError:
                        break
                    if r.request_holds_kv:
                        held.append(rid)
                out[name] = held
        return out

    async def blocks_used(self) -> dict[str, int]:
        out = {}
        for name, address, stub, req in self._targets():
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    r = await stub(ch).DescribeCache(req(), timeout=5)
                    out[name] = r.kv_blocks_used
                except grpc.aio.AioRpcError:
                    out[name] = -1
        return out


class _Phase:
    """One fault: the stream of requests, the injection, the probes, the drain."""

    def __init__(self, stack: Stack, cfg: ChaosConfig, fault: str, say) -> None:
        self.stack, self.cfg, self.fault, self.say = stack, cfg, fault, say
        self.pipeline = FAULTS[fault]
        self.engines = EngineProbe(stack)
        self.tag = f"{fault}-{uuid.uuid4().hex[:6]}"
        self.records: list[StreamRecord] = []
        self.injected_at: float | None = None
        self.victim = ""
        self.failures: list[dict] = []

    def _live(self, min_tokens: int) -> list[StreamRecord]:
        return [r for r in self.records if r.end_s is None and r.streamed >= min_tokens]

    async def _victim(self) -> str | None:
        """The process to hit now, or None while the fault's moment has not come."""
        n = self.cfg.in_flight
        if self.fault in ("kvstore", "redis"):
            return self.fault if len(self._live(0)) >= n else None
        if self.fault == "prefill":
            return self._prefill_mid_request() if len(self._live(0)) >= n else None
        # NOTE: MainDecode speaks from output 1, prefill's first token comes first: a request
        # with a token streamed and its KV still on the victim is mid-request there.
        if len(self._live(0)) < n:
            return None
        live = self._live(1)
        prefix = "relay" if self.fault == "relay" else "main_decode"
        held = await self.engines.holding([r.request_id for r in live], prefix)
        best = max(sorted(held.items()), key=lambda kv: len(kv[1]), default=("", []))
        return best[0] if best[1] else None

    def _prefill_mid_request(self) -> str | None:
        """The prefill that computed an in-flight request and still streams it (pushing its KV
        over the WAN): its log has the request's ``prefilled`` line, not yet ``rpc_finished``.

        NOTE: prefill's engine frees the request once its KV is exported, so DescribeCache
        cannot tell; its log can.
        """
        live = {r.request_id for r in self._live(0)}
        for p in self.stack.processes:
            if not p.name.startswith("prefill") or p.log_path is None:
                continue
            open_ids: set[str] = set()
            for line in p.log_path.read_text().splitlines():
                if self.tag not in line:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                rid = entry.get("request_id", "")
                if entry.get("event") == "prefilled":
                    open_ids.add(rid)
                elif entry.get("event") == "rpc_finished":
                    open_ids.discard(rid)
            if open_ids & live:
                return p.name
        return None

    async def _inject(self, victim: str) -> None:
        self.injected_at = time.monotonic()
        self.victim = victim
        if victim == "redis":
            assert self.stack.redis is not None
            self.stack.redis.send_signal(signal.SIGKILL)
        elif self.fault == "wan_partition":
            link = self.stack.by_name("wan-" + victim.rpartition("-")[2])
            self.victim = link.name
            self.say(f"  {self.fault}: SIGSTOP {link.name} with {len(self._live(0))} in flight")
            link.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(self.cfg.partition_s)
            finally:
                link.proc.send_signal(signal.SIGCONT)
            return
        else:
            self.stack.by_name(victim).proc.send_signal(signal.SIGKILL)
        self.say(f"  {self.fault}: SIGKILL {self.victim} with {len(self._live(0))} in flight")

    async def _injector(self, done: asyncio.Event, stub) -> float | None:
        """Inject at the fault's moment, then probe at once, while the stream still runs; the
        recovery time (None: never injected or never recovered)."""
        while not done.is_set():
            victim = await self._victim()
            if victim is not None:
                probe = asyncio.create_task(self._probe_recovery(stub))
                await self._inject(victim)
                return await probe
            await asyncio.sleep(0.02)
        return None

    async def _probe_recovery(self, stub) -> float | None:
        """Seconds from the injection until a new short request is served in full."""
        await asyncio.sleep(0)  # NOTE: _inject sets injected_at before its first await
        assert self.injected_at is not None
        req = ChaosRequest(-1, tuple(range(1, 17)), 8, None)
        i = 0
        while time.monotonic() - self.injected_at < self.cfg.recover_timeout_s:
            i += 1
            rec = StreamRecord(-1, f"chaos-probe-{self.tag}-{i}", False, 8)
            msg = _message(req, rec.request_id, f"probe-{self.tag}-{i}", self.pipeline)
            await _stream(stub, msg, rec, timeout=10)
            if rec.status == "OK" and check_stream(rec.chunks, 8).lost == 0:
                assert rec.end_s is not None
                return rec.end_s - self.injected_at
            await asyncio.sleep(0.1)
        return None

    async def run(
        self, requests: Sequence[ChaosRequest], reference: dict[int, list[int]]
    ) -> FaultRow:
        before = await self.engines.blocks_used()
        async with grpc.aio.insecure_channel(self.stack.gateway.address) as ch:
            stub = gw_grpc.GatewayServiceStub(ch)
            done = asyncio.Event()
            injector = asyncio.create_task(self._injector(done, stub))
            tasks = []
            t0 = time.monotonic()
            for req in requests:
                await asyncio.sleep(
                    max(0.0, t0 + req.index * self.cfg.interval_s - time.monotonic())
                )
                rec = StreamRecord(
                    req.index, f"chaos-{self.tag}-{req.index}", req.seed is not None, req.max_tokens
                )
                rec.start_s = time.monotonic()
                self.records.append(rec)
                msg = _message(req, rec.request_id, f"chaos-{self.tag}-{req.index}", self.pipeline)
                tasks.append(
                    asyncio.create_task(_stream(stub, msg, rec, self.cfg.request_timeout_s))
                )
            await asyncio.gather(*tasks)
            done.set()
            recover = await injector
        await wait_whole(self.stack, self.cfg.recover_timeout_s)
        await asyncio.sleep(self.cfg.drain_s)
        after = await self.engines.blocks_used()
        held = await self.engines.holding([r.request_id for r in self.records])
        self.failures = [
            {"index": r.index, "status": r.status, "message": r.message, "streamed": r.streamed}
            for r in self.records
            if r.status != "OK"
        ]
        return fault_row(
            self.fault,
            self.records,
            reference,
            pipeline=self.pipeline,
            injected_at_s=self.injected_at,
            recover_s=recover,
            kv_blocks_before=sum(v for v in before.values() if v > 0),
            kv_blocks_after=sum(v for v in after.values() if v > 0),
            requests_holding_kv=sum(len(v) for v in held.values()),
        )


async def wait_whole(stack: Stack, timeout_s: float) -> None:
    """Until every process (and the embedded Redis) is alive and listening again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs_ok = all(p.alive() and p.address for p in stack.processes)
        redis_ok = stack.redis is None or stack.redis.poll() is None
        if procs_ok and redis_ok:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the stack was not whole again within {timeout_s} s")


async def _served_again(stack: Stack, pipeline: str, timeout_s: float) -> None:
    """Until short requests are served in full, twice in a row (instances registered again)."""
    deadline = time.monotonic() + timeout_s
    ok = 0
    req = ChaosRequest(-1, tuple(range(1, 17)), 8, None)
    async with grpc.aio.insecure_channel(stack.gateway.address) as ch:
        stub = gw_grpc.GatewayServiceStub(ch)
        i = 0
        while ok < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests were not served again within {timeout_s} s")
            i += 1
            rec = StreamRecord(-1, f"chaos-ready-{uuid.uuid4().hex[:6]}", False, 8)
            await _stream(stub, _message(req, rec.request_id, rec.request_id, pipeline), rec, 10)
            ok = ok + 1 if rec.status == "OK" else 0
            await asyncio.sleep(0.2 if ok else 0.5)


async def _reference(
    stack: Stack, requests: Sequence[ChaosRequest], pipeline: str, cfg: ChaosConfig
) -> dict[int, list[int]]:
    """The fault-free outputs of ``requests`` (a failure here is no reference: raise)."""
    tag = f"ref-{pipeline or 'routed'}-{uuid.uuid4().hex[:6]}"
    async with grpc.aio.insecure_channel(stack.gateway.address) as ch:
        stub = gw_grpc.GatewayServiceStub(ch)
        recs = [
            StreamRecord(r.index, f"chaos-{tag}-{r.index}", r.seed is not None, r.max_tokens)
            for r in requests
        ]
        sem = asyncio.Semaphore(4)

        async def one(req: ChaosRequest, rec: StreamRecord) -> None:
            async with sem:
                msg = _message(req, rec.request_id, rec.request_id, pipeline)
                await _stream(stub, msg, rec, cfg.request_timeout_s)

        await asyncio.gather(*(one(q, r) for q, r in zip(requests, recs)))
    out = {}
    for rec in recs:
        check = check_stream(rec.chunks, rec.max_tokens)
        if rec.status != "OK" or check.lost or check.duplicated:
            raise RuntimeError(
                f"reference run ({pipeline or 'routed'}): request {rec.index} {rec.status} "
                f"{rec.message} (lost {check.lost}, duplicated {check.duplicated})"
            )
        out[rec.index] = list(check.tokens)
    return out


async def run_chaos(
    cfg: ChaosConfig, stack: Stack, details: list[dict], say=print
) -> list[FaultRow]:
    """Every fault of ``cfg`` in turn; ``details`` gets each one's victim and failed requests."""
    requests = chaos_requests(cfg)
    await _served_again(stack, "", cfg.recover_timeout_s)
    refs: dict[str, dict[int, list[int]]] = {}
    for pipeline in dict.fromkeys(FAULTS[f] for f in cfg.faults):
        say(f"reference run ({pipeline or 'routed'}): {len(requests)} requests")
        refs[pipeline] = await _reference(stack, requests, pipeline, cfg)
    rows = []
    for fault in cfg.faults:
        say(f"fault {fault}: {len(requests)} requests, one every {cfg.interval_s:g} s")
        phase = _Phase(stack, cfg, fault, say)
        row = await phase.run(requests, refs[FAULTS[fault]])
        rows.append(row)
        details.append({"fault": fault, "victim": phase.victim, "failures": phase.failures})
        say(markdown_table([row]).splitlines()[-1])
        await wait_whole(stack, cfg.recover_timeout_s)
        await _served_again(stack, FAULTS[fault], cfg.recover_timeout_s)
    return rows


def write_report(
    cfg: ChaosConfig, rows: Sequence[FaultRow], details: Sequence[dict], started: str
) -> None:
    cfg.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    body = {
        "started": started,
        "config": settings,
        "rows": [asdict(r) for r in rows],
        "details": list(details),
    }
    (cfg.out / "chaos.json").write_text(json.dumps(body, indent=2) + "\n")
    moments = "\n".join(f"- {r.fault}: {r.moment}" for r in rows)
    (cfg.out / "chaos.md").write_text(
        f"# pdd chaos, {started}\n\n{markdown_table(rows)}\n\nInjected when:\n{moments}\n"
    )


def parse_args(argv: Sequence[str]) -> ChaosConfig:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="pdd chaos", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=d.out, help="folder for chaos.json, chaos.md, logs")
    p.add_argument(
        "--faults", default=",".join(d.faults), help=f"comma-separated, of {', '.join(FAULTS)}"
    )
    p.add_argument("--requests", type=int, default=d.requests, help="requests per fault")
    p.add_argument("--interval-s", type=float, default=d.interval_s)
    p.add_argument("--in-flight", type=int, default=d.in_flight, help="inject at >= N in flight")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--wan-delay-ms", type=float, default=d.wan_delay_ms)
    p.add_argument("--partition-s", type=float, default=d.partition_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--stage-timeout-s", type=float, default=d.stage_timeout_s)
    p.add_argument("--model", default=d.model)
    a = p.parse_args(list(argv))
    return ChaosConfig(
        out=a.out,
        faults=tuple(f for f in a.faults.split(",") if f),
        requests=a.requests,
        interval_s=a.interval_s,
        in_flight=a.in_flight,
        min_tokens=a.min_tokens,
        max_tokens=a.max_tokens,
        seed=a.seed,
        wan_delay_ms=a.wan_delay_ms,
        partition_s=a.partition_s,
        request_timeout_s=a.request_timeout_s,
        stage_timeout_s=a.stage_timeout_s,
        model=a.model,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    stack = Stack(stack_config(cfg)).start()
    details: list[dict] = []
    try:
        rows = asyncio.run(run_chaos(cfg, stack, details))
    finally:
        stack.stop()
    write_report(cfg, rows, details, started)
    print(markdown_table(rows))
    print(f"wrote {cfg.out / 'chaos.json'} and {cfg.out / 'chaos.md'}")
    unclean = [r.fault for r in rows if not r.clean]
    if unclean:
        print(f"not clean: {', '.join(unclean)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
