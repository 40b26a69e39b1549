"""``pdd bench link``: how close the KV links come to what they are given.

One run, all on loopback in this process:

1. the WAN emulator alone — raw TCP throughput and ping RTT against the
   configured ``--mbps`` / ``--delay-ms``;
2. the real WAN path — ``KvPusher`` → gRPC ``PushKv`` → emulator →
   ``KvReceiver`` — for KV of each ``--sizes-mb``: achieved throughput (payload
   over the time from the header's arrival to the last chunk's, at the
   receiver), time to last byte (push start to the sender holding the
   receiver's confirmation) against its ideal (line rate + one RTT), and wire
   overhead per chunk (bytes the emulator carried beyond the payload);
3. the shared-memory fast link — prepare, write, completion — against a plain
   memory copy of the same bytes, the two alternating;
4. the WAN push's CPU per MiB at each end, the receiver in a process of its own
   (``push_cpu``: a P-MD burst of 16 prompts' KV, no emulator in the way).

The JSON written to ``--out`` holds ``configured_mbps``, ``achieved_mbps`` (the
WAN path for the largest size), ``fast_link_gbps``, ``memcpy_gbps`` and the
details. Targets: WAN ≥ 90% of the emulated bandwidth for ≥ 4 MB; emulator
bandwidth and RTT within 5%; shm ≥ 50% of memcpy (issue 19).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
import numpy as np
import structlog

from pdd.kv.checksum import ACCELERATED
from pdd.kv.fast_link.receiver import FastLinkReceiver
from pdd.kv.fast_link.region import PrepareRequest
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import ShmReceiverBackend, ShmSenderBackend
from pdd.kv.fast_link.state import Transport
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.receiver import KvReceiver, ReceiverConfig
from pdd.kv.source import BytesSource
from pdd.kv.transfer import make_header
from pdd.kv.wan import KvPusher
from pdd.telemetry.logging import configure_logging
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator
from pdd.testbed.push_cpu import add_sink
from pdd.testbed.push_cpu import measure as measure_push_cpu

# 8 layers x K,V x 4 heads x 64 dims x bf16 = 8 KiB per token: sizes come out exact in MiB.
_LAYOUT = KvLayout(KvDtype.BFLOAT16, num_layers=8, num_kv_heads=4, head_dim=64)  # 8 KiB per token
_MIB = 1 << 20
_PROBE_MAX_BYTES = 512 * _MIB  # the raw probe's most bytes, whatever the link


@dataclass(frozen=True)
class BenchConfig:
    mbps: float = 200.0
    delay_ms: float = 10.0
    jitter_ms: float = 0.0
    sizes_mb: tuple[int, ...] = (1, 4, 16)
    chunk_kib: int = 1024
    fast_link_mb: int = 64
    # Link time spent measuring the emulator's raw throughput.
    probe_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mbps <= 0:
            raise ValueError(f"mbps: the benchmark needs a finite bandwidth, got {self.mbps}")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms: delay and jitter must be >= 0")
        if not self.sizes_mb or min(self.sizes_mb) <= 0:
            raise ValueError(f"sizes_mb: must be positive sizes, got {self.sizes_mb}")
        if self.chunk_kib <= 0 or self.fast_link_mb <= 0:
            raise ValueError("chunk_kib: chunk and fast-link sizes must be positive")
        if self.probe_s <= 0:
            raise ValueError(f"probe_s: must be positive, got {self.probe_s}")


async def _raw_link(config: LinkConfig, probe_s: float) -> dict[str, float]:
    """Throughput (receiver-side first→last byte) and ping RTT of the emulator alone."""
    spans: list[float] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, n = None, 0
        while data := await reader.read(1 << 16):
            if data == b"p":
                writer.write(b"p")
                await writer.drain()
                continue
            first = first or time.monotonic()
            n += len(data)
        spans.append(time.monotonic() - first if first else 0.0)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    # NOTE: capped and written in pieces: a fast link's probe_s of bytes at once (12.5 GB at
    # 100 Gbit/s) was allocated whole and got the bench killed for memory.
    size = min(_PROBE_MAX_BYTES, max(_MIB, int(config.bytes_per_s * probe_s)))
    async with LinkEmulator(config, f"127.0.0.1:{server.sockets[0].getsockname()[1]}") as em:
        host, port = em.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        rtts = []
        for _ in range(10):
            start = time.monotonic()
            writer.write(b"p")
            await writer.drain()
            await reader.readexactly(1)
            rtts.append(time.monotonic() - start)
        piece = bytes(_MIB)
        for offset in range(0, size, _MIB):
            writer.write(piece[: min(_MIB, size - offset)])
            await writer.drain()
        writer.write_eof()
        await reader.read()
        writer.close()
    server.close()
    # The first byte is released after one quantum's transmission: count from there.
    return {
        "emulator_mbps": round((size - config.quantum) * 8 / spans[0] / 1e6, 2),
        "emulator_rtt_ms": round(statistics.median(rtts) * 1e3, 3),
        "emulator_bytes": size,
    }


async def _wan_path(cfg: BenchConfig, link: LinkConfig) -> list[dict[str, float]]:
    streamed: dict[str, float] = {}  # request id → header arrival to delivery, at the receiver
    receiver = KvReceiver(
        ReceiverConfig(max_transfer_bytes=max(cfg.sizes_mb) * _MIB * 2),
        on_complete=lambda kv: streamed.__setitem__(kv.header.request_id, kv.elapsed_s),
    )
    server = grpc.aio.server()
    add_sink(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rows = []
    try:
        async with LinkEmulator(link, f"127.0.0.1:{port}") as em:
            async with grpc.aio.insecure_channel(em.address) as channel:
                pusher = KvPusher.for_channel(channel)
                for i, size_mb in enumerate((1, *cfg.sizes_mb)):  # the first push only warms up
                    tokens = size_mb * _MIB // _LAYOUT.bytes_per_token
                    header = make_header(
                        f"bench-{i}", _LAYOUT, 0, tokens, chunk_bytes=cfg.chunk_kib << 10
                    )
                    payload = os.urandom(header.total_bytes)
                    em.reset_counters()
                    report = await pusher.push(header, BytesSource(payload))
                    if i == 0:
                        continue
                    wire = em.stats()
                    bits = header.total_bytes * 8
                    achieved = bits / streamed[header.request_id] / 1e6
                    # Best possible: the bytes at line rate, plus the first byte's trip and the answer's.
                    ideal = bits / (cfg.mbps * 1e6) + 2 * cfg.delay_ms / 1e3
                    rows.append(
                        {
                            "size_mb": size_mb,
                            "chunks": header.num_chunks,
                            "achieved_mbps": round(achieved, 2),
                            "efficiency": round(achieved / cfg.mbps, 4),
                            "ttlb_s": round(report.elapsed_s, 4),
                            "ttlb_ideal_s": round(ideal, 4),
                            "ttlb_mbps": round(bits / report.elapsed_s / 1e6, 2),
                            "ttlb_vs_ideal": round(ideal / report.elapsed_s, 4),
                            "wire_bytes_up": wire.bytes_up,
                            "wire_bytes_down": wire.bytes_down,
                            "per_chunk_overhead_bytes": round(
                                (wire.bytes_up - header.total_bytes) / header.num_chunks, 1
                            ),
                            "attempts": report.attempts,
                        }
                    )
    finally:
        await server.stop(None)
    return rows


async def _fast_link(size_mb: int, runs: int = 7) -> dict[str, float]:
    """Shared-memory transfers and plain copies of the same bytes, alternating (so that other
    load on the host weighs on both alike); medians. The first transfer, which creates and maps
    the segment, is left out as warm-up, as the faulting in of the copy's destination is."""
    nbytes = size_mb * _MIB
    tokens = nbytes // _LAYOUT.bytes_per_token
    payload = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    shm = ShmReceiverBackend()
    relay = FastLinkReceiver([shm])
    sender = FastLinkSender([ShmSenderBackend()])
    dst = np.empty_like(payload)
    np.copyto(dst, payload)  # fault the destination in, as the segment is at prepare
    fast, copies = [], []
    try:
        for i in range(runs + 1):
            start = time.monotonic()
            reservation = await relay.prepare(
                PrepareRequest(f"fl-{i}", _LAYOUT, tokens, nbytes, (Transport.SHM,))
            )
            prepared = time.monotonic()
            header = make_header(f"fl-{i}", _LAYOUT, 0, tokens)
            report = await sender.send(
                reservation, header, BytesSource(memoryview(payload)), relay.complete
            )
            relay.release(reservation.transfer_id)
            start_copy = time.perf_counter()
            np.copyto(dst, payload)
            if i:
                copies.append(time.perf_counter() - start_copy)
                fast.append((prepared - start, report.write_s, report.complete_s))
    finally:
        shm.close()
    prepare_s, write_s, complete_s = (statistics.median(x) for x in zip(*fast, strict=True))
    fast_gbps = nbytes / statistics.median(w + c for _, w, c in fast) / 1e9
    memcpy = nbytes / statistics.median(copies) / 1e9
    return {
        "fast_link_mb": size_mb,
        "fast_link_gbps": round(fast_gbps, 3),
        "memcpy_gbps": round(memcpy, 3),
        "fast_link_vs_memcpy": round(fast_gbps / memcpy, 4),
        "fast_link_prepare_ms": round(prepare_s * 1e3, 2),
        "fast_link_write_ms": round(write_s * 1e3, 2),
        "fast_link_complete_ms": round(complete_s * 1e3, 2),
    }


async def run_bench(cfg: BenchConfig) -> dict[str, object]:
    link = LinkConfig(mbps=cfg.mbps, delay_ms=cfg.delay_ms, jitter_ms=cfg.jitter_ms)
    raw = await _raw_link(link, cfg.probe_s)
    wan = await _wan_path(cfg, link)
    fast = await _fast_link(cfg.fast_link_mb)
    push_cpu = await measure_push_cpu()
    largest = max(wan, key=lambda r: r["size_mb"])
    bw_error = raw["emulator_mbps"] / cfg.mbps - 1
    rtt_error = raw["emulator_rtt_ms"] / (2 * cfg.delay_ms) - 1 if cfg.delay_ms else None
    return {
        "configured_mbps": cfg.mbps,
        "configured_delay_ms": cfg.delay_ms,
        "configured_rtt_ms": 2 * cfg.delay_ms,
        "achieved_mbps": largest["achieved_mbps"],
        **raw,
        "emulator_bandwidth_error": round(bw_error, 4),
        "emulator_rtt_error": round(rtt_error, 4) if rtt_error is not None else None,
        "wan": wan,
        **fast,
        "wan_push_cpu": push_cpu,
        "targets": {
            "wan_ge_90pct_from_4mb": all(r["efficiency"] >= 0.9 for r in wan if r["size_mb"] >= 4),
            "emulator_bandwidth_within_5pct": abs(bw_error) <= 0.05,
            "emulator_rtt_within_5pct": rtt_error is None or abs(rtt_error) <= 0.05,
            "fast_link_ge_50pct_memcpy": fast["fast_link_vs_memcpy"] >= 0.5,
        },
        "config": asdict(cfg),
        "cpus": os.cpu_count(),
        "crc_accelerated": ACCELERATED,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd bench link", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mbps", type=float, default=BenchConfig.mbps, help="emulated bandwidth per direction"
    )
    p.add_argument("--delay-ms", type=float, default=BenchConfig.delay_ms, help="one-way delay")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--sizes-mb", default="1,4,16", help="KV sizes to push, comma-separated MiB")
    p.add_argument("--chunk-kib", type=int, default=BenchConfig.chunk_kib)
    p.add_argument("--fast-link-mb", type=int, default=BenchConfig.fast_link_mb)
    p.add_argument(
        "--probe-s",
        type=float,
        default=BenchConfig.probe_s,
        help="link time spent on the emulator's raw throughput",
    )
    p.add_argument("--out", help="write the JSON result here (default: stdout only)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if not structlog.is_configured():  # run on its own: keep stdout for the JSON
        configure_logging("bench-link", level=args.log_level, json=False)
    try:
        cfg = BenchConfig(
            args.mbps,
            args.delay_ms,
            args.jitter_ms,
            tuple(int(s) for s in args.sizes_mb.split(",") if s),
            args.chunk_kib,
            args.fast_link_mb,
            args.probe_s,
        )
    except ValueError as e:
        p.error(str(e))
    result = asyncio.run(run_bench(cfg))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
