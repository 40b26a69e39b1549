"""Prefill overlaps compute and transfer: the WAN push starts before the prompt is done.

The prefill domain runs in-process with a real engine (chunked prefill of 16
tokens per step) and pushes over real gRPC to a test peer — a MainDecode
``PushKv``/``GetKvTransfer`` servicer backed by the real ``KvReceiver`` — which
records when each chunk arrives. The reassembled KV must equal the engine's
own export, and chunks must arrive before the first token is sampled.
"""

from __future__ import annotations

import time

import grpc
import torch

from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import FirstToken, PrefillJob, TransferDone
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.kv import messages as kv_convert
from pdd.kv.compression import decode_tensor
from pdd.kv.receiver import KvReceiver
from pdd.server.tls import TlsConfig
from pdd.serving.channels import Channels
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.model_spec import load_model
from pdd.serving.prefill import Prefill, PrefillConfig

MODEL = "tiny:3,ctx=1024,layers=4,hidden=128,inter=256"


class RecordingMainDecode(md_grpc.MainDecodeServiceServicer):
    def __init__(self) -> None:
        self.receiver = KvReceiver()
        self.chunk_times: list[float] = []

    async def PushKv(self, request_iterator, context):
        async def items():
            async for msg in request_iterator:
                if msg.WhichOneof("item") == "chunk":
                    self.chunk_times.append(time.perf_counter())
                yield kv_convert.push_item_from_pb(msg)

        return kv_convert.push_response_to_pb(await self.receiver.receive(items()))

    async def GetKvTransfer(self, request, context):
        return kv_convert.transfer_status_to_pb(self.receiver.status(request.request_id))


class _Instance:
    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner


async def test_push_starts_before_prefill_finishes_and_delivers_exact_kv():
    peer = RecordingMainDecode()
    server = grpc.aio.server()
    md_grpc.add_MainDecodeServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine = Engine(load_model(MODEL), EngineConfig(block_size=4, max_num_batched_tokens=16))
    runner = EngineLoop(engine)
    await runner.start()
    channels = Channels(TlsConfig())
    try:
        # NOTE: 1 KiB chunks so each 16-token prefill step yields several chunks to send at once.
        prefill = Prefill(_Instance(engine, runner), channels, PrefillConfig(wan_chunk_bytes=1024))
        prompt = tuple(1 + i % 250 for i in range(300))
        md_from = 40
        job = PrefillJob(
            "r1",
            prompt,
            SamplingParams(max_tokens=8),
            "",
            Pipeline.P_MD,
            InstanceRef("md", f"127.0.0.1:{port}", Role.MAIN_DECODE),
            md_from,
        )
        events = []
        async for ev in prefill.prefill(job):
            events.append((time.perf_counter(), ev))
        (t_first, first), (_, done) = events
        assert isinstance(first, FirstToken) and isinstance(done, TransferDone)
        assert first.prompt_tokens == 300 and first.cached_tokens == 0
        # overlap: the first chunks crossed while later chunks of the prompt were still computing
        assert peer.chunk_times and peer.chunk_times[0] < t_first
        received = peer.receiver.pop("r1")
        assert received.output_token_ids == (first.token_id,)
        assert (received.header.start_token, received.header.num_tokens) == (md_from, 300 - md_from)
        assert done.wan_kv_bytes == received.header.total_bytes

        # The delivered KV equals what a fresh engine computes for the same prompt.
        ref = Engine(load_model(MODEL), EngineConfig(block_size=4))
        ref.add_request("x", prompt, SamplingParams(max_tokens=1), keep_after_finish=True)
        while ref.step() == []:
            pass
        expect = (
            ref.export_kv("x", md_from, 300).to_tensor().permute(2, 0, 1, 3, 4)
        )  # [n, L, 2, KV, D]
        got = decode_tensor(received.payload, received.header.layout, 300 - md_from)
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)
        assert not engine.holds_request("r1")  # released right after export
    finally:
        await runner.stop()
        await channels.close()
        await server.stop(0)
