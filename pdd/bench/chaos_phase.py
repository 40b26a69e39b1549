"""One fault of a chaos run: the stream of requests, the injection, the recovery probes, the drain."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Sequence

import grpc

from pdd.bench.chaos_config import (
    FAULTS,
    PIPELINES,
    SEEDED_TEMPERATURE,
    ChaosConfig,
    ChaosRequest,
)
from pdd.bench.chaos_measure import FaultRow, StreamRecord, check_stream, fault_row
from pdd.bench.engine_probe import EngineProbe
from pdd.gen.common.v1 import common_pb2
from pdd.gen.gateway.v1 import gateway_service_pb2 as gw_pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as gw_grpc
from pdd.testbed.stack import Stack


def chaos_message(req: ChaosRequest, rid: str, salt: str, pipeline: str) -> gw_pb.GenerateRequest:
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


async def stream_into(
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


class FaultPhase:
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
            link = self.stack.by_name(self.stack.link_of[victim])
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
            msg = chaos_message(req, rec.request_id, f"probe-{self.tag}-{i}", self.pipeline)
            await stream_into(stub, msg, rec, timeout=10)
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
                msg = chaos_message(
                    req, rec.request_id, f"chaos-{self.tag}-{req.index}", self.pipeline
                )
                tasks.append(
                    asyncio.create_task(stream_into(stub, msg, rec, self.cfg.request_timeout_s))
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
