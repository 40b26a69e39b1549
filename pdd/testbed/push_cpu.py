"""``pdd bench link``'s WAN push CPU: what moving a MiB of KV costs each end, in its own process.

A P-MD burst hands MainDecode the KV of every prompt at once (16 prompts of 128 tokens of the
served benchmark's model: 16 × 2.5 MiB), and on one host both ends of that push share the
cores with the engines. This measure runs the real path — ``KvPusher`` (this process) → gRPC
``PushKv`` over loopback → a ``KvReceiver`` behind MainDecode's handler (a spawned process,
``push_codec`` reading its requests as MainDecode's does) — for ``bursts`` bursts of ``pushes``
pushes through ``streams`` pool slots, both ends' malloc tuned as every service's is
(``pdd.server.heap``), and reports medians over the bursts after the first: the burst's wall
time, and each end's CPU per MiB (this process from its own clock, the receiver from its
threads' ``schedstat``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as mdgrpc
from pdd.kv import messages as convert
from pdd.kv import push_codec
from pdd.kv.layout import KvDtype, KvLayout
from pdd.kv.receiver import KvReceiver, ReceiverConfig
from pdd.kv.source import BytesSource
from pdd.kv.stream_pool import StreamPool
from pdd.kv.transfer import make_header
from pdd.kv.wan import KvPusher
from pdd.server import heap
from pdd.server.handlers import register_overriding

# The served benchmark's random Llama: 10 layers x K,V x 4 KV heads x 64 dims x fp32.
SERVED_LAYOUT = KvLayout(KvDtype.FLOAT32, num_layers=10, num_kv_heads=4, head_dim=64)
_MIB = 1 << 20


class ReceiverSink(mdgrpc.MainDecodeServiceServicer):
    """``PushKv`` / ``GetKvTransfer`` over a ``KvReceiver``, delivered payloads dropped."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def PushKv(self, request_iterator, context):  # noqa: N802 — gRPC method name
        status = await self.receiver.receive(push_codec.push_items_from_wire(request_iterator))
        self.receiver.pop(status.request_id)
        return convert.push_response_to_pb(status)

    async def GetKvTransfer(self, request, context):  # noqa: N802
        return convert.transfer_status_to_pb(self.receiver.status(request.request_id))


def add_sink(server: grpc.aio.Server, receiver: KvReceiver) -> None:
    """A ``ReceiverSink`` on ``server``, its ``PushKv`` read as MainDecode reads it."""
    sink = ReceiverSink(receiver)
    register_overriding(
        mdgrpc.add_MainDecodeServiceServicer_to_server,
        sink,
        server,
        {"PushKv": push_codec.push_kv_handler(sink.PushKv)},
    )


@dataclass(frozen=True)
class PushCpuConfig:
    pushes: int = 16
    tokens: int = 128
    streams: int = 4
    bursts: int = 8

    def __post_init__(self) -> None:
        if min(self.pushes, self.tokens, self.streams) <= 0 or self.bursts < 2:
            raise ValueError("pushes: pushes, tokens and streams must be positive, bursts >= 2")


def _serve(port_out) -> None:
    """The receiving process: a gRPC server until killed; its port goes to ``port_out``."""
    heap.tune()

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_sink(server, KvReceiver(ReceiverConfig(max_transfer_bytes=1 << 30)))
        port_out.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _cpu_s(pid: int) -> float | None:
    """CPU seconds of every thread of ``pid`` (Linux ``schedstat``); None where unreadable."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # NOTE: a thread that ended meanwhile
    return total / 1e9


async def measure(cfg: PushCpuConfig = PushCpuConfig()) -> dict[str, object]:
    heap.tune()
    ctx = multiprocessing.get_context("spawn")  # NOTE: gRPC must not be forked
    read_end, write_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve, args=(write_end,), daemon=True)
    proc.start()
    try:
        port = await asyncio.to_thread(read_end.recv)
        payload = os.urandom(SERVED_LAYOUT.nbytes(cfg.tokens))
        mib = cfg.pushes * len(payload) / _MIB
        rows = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            pusher = KvPusher.for_channel(channel, pool=StreamPool(cfg.streams))
            for burst in range(cfg.bursts):
                headers = [
                    make_header(f"cpu-{burst}-{i}", SERVED_LAYOUT, 0, cfg.tokens)
                    for i in range(cfg.pushes)
                ]
                theirs, ours, start = _cpu_s(proc.pid), time.process_time(), time.perf_counter()
                await asyncio.gather(*(pusher.push(h, BytesSource(payload)) for h in headers))
                wall, ours = time.perf_counter() - start, time.process_time() - ours
                after = _cpu_s(proc.pid)
                spent = after - theirs if after is not None and theirs is not None else None
                if burst:  # NOTE: the first burst warms the channel and both heaps
                    rows.append((wall, ours, spent))
    finally:
        proc.kill()
        proc.join()
    walls, senders, receivers = zip(*rows, strict=True)
    known = [r for r in receivers if r is not None]
    return {
        "pushes": cfg.pushes,
        "push_bytes": len(payload),
        "streams": cfg.streams,
        "burst_ms": round(statistics.median(walls) * 1e3, 1),
        "mib_per_s": round(mib / statistics.median(walls), 1),
        "sender_cpu_ms_per_mib": round(statistics.median(senders) * 1e3 / mib, 3),
        "receiver_cpu_ms_per_mib": (
            round(statistics.median(known) * 1e3 / mib, 3) if known else None
        ),
    }
