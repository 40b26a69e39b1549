"""Prefill's request life: compute the uncached suffix, sample, ship the KV.

Life of a request (one ``prefill`` generator per request, opened by the gateway):
  1. ``add_request`` with ``max_tokens=1``: the prompt is matched against
     prefill's own radix cache, only the rest is computed (chunked), and the
     first token is sampled with the request's own sampling settings — the
     draw depends only on (seed, position), so every stage agrees;
  2. the first token is reported at once (it is the user's TTFT);
  3. the KV leaves the engine in the canonical wire format and goes, at the
     same time, (a) in full to the relay over the fast link (P-RLD-MD only)
     and (b) from ``main_decode_cached_tokens`` on — only what MainDecode's
     DRC lacks — over the WAN as a resumable ``PushKv`` stream, waiting for a
     slot of the link's bounded stream pool;
  4. the request's KV is released as soon as it is exported (its prompt
     blocks stay in the radix cache for the next turn), and ``TransferDone``
     reports bytes and times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import structlog

from pdd.core.errors import FailedPreconditionError, InvalidArgumentError
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import FirstToken, PrefillJob, TransferDone
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as md_grpc
from pdd.gen.relay.v1 import relay_service_pb2_grpc as r_grpc
from pdd.kv import messages as kv_convert
from pdd.kv.fast_link.region import PrepareRequest
from pdd.kv.fast_link.select import usable_candidates
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import ShmSenderBackend
from pdd.kv.fast_link.state import TransferState, Transport
from pdd.kv.fast_link.tcp import TcpSenderBackend
from pdd.kv.layout import KvDtype
from pdd.kv.source import StreamedSource
from pdd.kv.stream_pool import StreamPool
from pdd.kv.transfer import DEFAULT_CHUNK_BYTES, Compression, TransferHeader
from pdd.kv.wan import KvPusher, PusherConfig
from pdd.server.interceptors import outgoing_metadata
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import export_tokens, range_header, wire_bytes
from pdd.telemetry import metrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    # Concurrent KV pushes per WAN link (the report's connection pool).
    wan_streams: int = 4
    wan_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # KV dtype on the WAN (None: the engine's); e.g. bfloat16 halves the bytes.
    wan_dtype: KvDtype | None = None
    wan_compression: Compression = Compression.NONE
    # Fast-link transports in preference order ("auto": RDMA, then shm, then TCP).
    fast_link: str = "auto"
    # Whether the relay shares this host (enables the shared-memory transport).
    relay_same_host: bool = True

    def __post_init__(self) -> None:
        if self.wan_streams < 1:
            raise ValueError(f"wan_streams: must be >= 1, got {self.wan_streams}")
        if self.wan_chunk_bytes < 1024:
            raise ValueError(f"wan_chunk_bytes: must be >= 1024, got {self.wan_chunk_bytes}")


def offered_transports(preference: str, same_host: bool) -> tuple[Transport, ...]:
    """The fast-link transports prefill offers the relay, best first: probed once, logged."""
    offered = usable_candidates(preference, same_host)
    log.info("fast_link_transports", offered=[t.value for t in offered], same_host=same_host)
    return offered


class _Link:
    """One outgoing KV range: its header and a source fed token by token as prefill computes."""

    def __init__(self, header: TransferHeader) -> None:
        self.header = header
        self._pieces: asyncio.Queue = asyncio.Queue()
        self.source = StreamedSource(header.total_bytes, self._drain())

    def feed(self, kv_token_major, start: int) -> None:
        """Tokens ``[start, start + len(kv))`` were computed; queue the part inside this range."""
        lo = max(start, self.header.start_token) - start
        if lo < kv_token_major.shape[0]:
            self._pieces.put_nowait(wire_bytes(kv_token_major[lo:], self.header.layout))

    async def _drain(self):
        while True:
            yield await self._pieces.get()


class Prefill:
    def __init__(
        self, instance: EngineInstance, channels: Channels, config: PrefillConfig = PrefillConfig()
    ) -> None:
        self.instance = instance
        self.channels = channels
        self.config = config
        self._pools: dict[str, StreamPool] = {}
        self._active: set[str] = set()
        self.transports = offered_transports(config.fast_link, config.relay_same_host)

    @property
    def runner(self):
        return self.instance.runner

    @property
    def engine(self):
        return self.instance.engine

    async def prefill(self, job: PrefillJob) -> AsyncIterator[FirstToken | TransferDone]:
        rid = job.request_id
        n = len(job.prompt_token_ids)
        md_from = job.main_decode_cached_tokens
        if not 0 <= md_from <= n:
            raise InvalidArgumentError("main_decode_cached_tokens", f"must be in [0, {n}]")
        if job.pipeline is Pipeline.P_RLD_MD and job.relay is None:
            raise InvalidArgumentError("relay", "is required for the P-RLD-MD pipeline")
        if rid in self._active:
            raise InvalidArgumentError("request_id", f"{rid!r} is already being prefilled here")
        self._active.add(rid)
        queue = self.runner.open(rid)
        self.runner.watch(rid)
        cfg = self.config
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        links: list[_Link] = [
            _Link(
                range_header(
                    self.engine,
                    rid,
                    md_from,
                    n,
                    job.prompt_token_ids,
                    job.cache_salt,
                    wire_dtype=cfg.wan_dtype,
                    compression=cfg.wan_compression,
                    chunk_bytes=cfg.wan_chunk_bytes,
                )
            )
        ]
        if job.pipeline is Pipeline.P_RLD_MD:
            links.append(
                _Link(range_header(self.engine, rid, 0, n, job.prompt_token_ids, job.cache_salt))
            )
        # NOTE: both pushes start now and stream each chunk of the prompt as soon as it is computed.
        tasks = [asyncio.create_task(self._push_wan(job, links[0], first))]
        if len(links) > 1:
            tasks.append(asyncio.create_task(self._send_fast(job, links[1], first)))
        held = finished = False
        try:
            t0 = time.perf_counter()

            def admit() -> int:
                self.engine.add_request(
                    rid,
                    job.prompt_token_ids,
                    replace(job.sampling, max_tokens=1),
                    salt=job.cache_salt,
                    keep_after_finish=True,
                )
                return self.engine.num_cached_tokens(rid)

            cached = await self.runner.call(admit)
            held = True
            metrics.PREFIX_QUERIES.labels("prefill").inc(n)
            metrics.PREFIX_HITS.labels("prefill").inc(cached)
            exported = 0
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                done = not isinstance(item, tuple)
                upto = n if done else min(item[1], n)
                if upto > exported:
                    kv = await self.runner.call(export_tokens, self.engine, rid, exported, upto)
                    for link in links:
                        link.feed(kv, exported)
                    exported = upto
                if done:
                    break
            token = item.token_id
            prefill_ms = (time.perf_counter() - t0) * 1000
            log.info(
                "prefilled", prompt_tokens=n, cached_tokens=cached, prefill_ms=round(prefill_ms, 2)
            )
            first.set_result((token,))
            # NOTE: the token leaves before any housekeeping: awaiting the engine thread first let it
            # wait behind the event loop's other work (the KV pushes starting) — 10-150 ms of TTFT.
            yield FirstToken(token, n, cached, prefill_ms, item.logprob)
            await self.runner.call(self.engine.release, rid)
            held = False
            wan = await tasks[0]
            relay = (0, 0.0, "")
            if len(tasks) > 1:
                try:
                    relay = await tasks[1]
                except Exception as exc:  # noqa: BLE001
                    # NOTE: a lost relay must not fail the request: MainDecode has its KV over the
                    # WAN, and the gateway hands the tokens it streamed over to MainDecode itself.
                    log.warning(
                        "fast_link_failed",
                        relay=job.relay.instance_id if job.relay else "",
                        error=f"{type(exc).__name__}: {exc}",
                    )
                    relay = (0, 0.0, "failed")
            finished = True
            yield TransferDone(
                relay[0],
                wan.wire_bytes,
                relay[1] * 1000,
                wan.elapsed_s * 1000,
                wan.queue_wait_s * 1000,
                relay[2],
            )
        finally:
            self._active.discard(rid)
            self.runner.close(rid)
            if not finished:
                for task in tasks:
                    task.cancel()
                if not first.done():
                    first.cancel()
            if held:
                self.runner.submit(self._drop, rid)  # NOTE: not awaited: runs even when cancelled

    def _drop(self, rid: str) -> None:
        self.engine.abort(rid)  # NOTE: frees a kept (finished) request too

    async def _push_wan(self, job: PrefillJob, link: _Link, first: asyncio.Future):
        header = link.header
        address = job.main_decode.address
        # NOTE: P-MD deltas are small and on the user's critical path (MainDecode decodes every
        # token); P-RLD-MD deltas are bulk that the relay hides. Separate lanes, separate pools.
        lane = "urgent" if job.pipeline is Pipeline.P_MD else "bulk"
        pool = self._pools.get(f"{address}#{lane}")
        if pool is None:
            pool = self._pools[f"{address}#{lane}"] = StreamPool(self.config.wan_streams)
            metrics.LIVE.watch_pool(pool)
        stub = md_grpc.MainDecodeServiceStub(self.channels.get(address, lane))
        pusher = KvPusher.for_stub(
            stub, config=PusherConfig(), pool=pool, metadata=outgoing_metadata()
        )
        report = await pusher.push(header, link.source, output_token_ids=first)
        metrics.WAN_BYTES.labels("sent").inc(report.wire_bytes)
        metrics.WAN_TRANSFER.labels("sent").observe(report.elapsed_s)
        metrics.WAN_QUEUE.observe(report.queue_wait_s)
        log.info(
            "wan_pushed",
            bytes=report.wire_bytes,
            tokens=header.num_tokens,
            start=header.start_token,
            queue_ms=round(report.queue_wait_s * 1000, 2),
            elapsed_ms=round(report.elapsed_s * 1000, 2),
        )
        return report

    async def _send_fast(self, job: PrefillJob, link: _Link, first: asyncio.Future):
        assert job.relay is not None
        header = link.header
        stub = r_grpc.RelayServiceStub(self.channels.get(job.relay.address))
        meta = outgoing_metadata()
        request = PrepareRequest(
            job.request_id, header.layout, header.num_tokens, header.total_bytes, self.transports
        )
        reservation = kv_convert.reservation_from_pb(
            await stub.PrepareTransfer(kv_convert.prepare_request_to_pb(request), metadata=meta),
            request,
        )
        sender = FastLinkSender(
            [ShmSenderBackend(), TcpSenderBackend.for_stub(stub, metadata=meta)]
        )

        async def complete(completion):
            resp = await stub.CompleteTransfer(
                kv_convert.completion_to_pb(completion), metadata=meta
            )
            return resp.accepted

        t0 = time.perf_counter()
        report = await sender.send(reservation, header, link.source, complete, first)
        if report.state is not TransferState.COMPLETED:
            raise FailedPreconditionError(
                f"fast link to {job.relay.instance_id} failed: {report.state.value}"
            )
        elapsed, transport = time.perf_counter() - t0, reservation.transport.value
        metrics.FAST_LINK_BYTES.labels(transport).inc(header.total_bytes)
        metrics.FAST_LINK_TRANSFER.labels(transport).observe(elapsed)
        return header.total_bytes, elapsed, transport
