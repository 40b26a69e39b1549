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

Settings in ``chaos_config``, one fault's run in ``chaos_phase``; the measurement (``chaos_measure``:
``check_stream``, ``fault_row``) is pure: recorded streams in, numbers out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import grpc

from pdd.bench.chaos_config import FAULTS, ChaosConfig, ChaosRequest, chaos_requests, stack_config
from pdd.bench.chaos_measure import FaultRow, StreamRecord, check_stream, markdown_table
from pdd.bench.chaos_phase import FaultPhase, chaos_message, stream_into, wait_whole
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as gw_grpc
from pdd.testbed.stack import Stack


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
            await stream_into(
                stub, chaos_message(req, rec.request_id, rec.request_id, pipeline), rec, 10
            )
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
                msg = chaos_message(req, rec.request_id, rec.request_id, pipeline)
                await stream_into(stub, msg, rec, cfg.request_timeout_s)

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
        phase = FaultPhase(stack, cfg, fault, say)
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
