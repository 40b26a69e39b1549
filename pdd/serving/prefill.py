"""Prefill's request life: compute the uncached suffix, sample, ship the KV.

Life of a request (one ``prefill`` generator per request, opened by the gateway):
  1. admit: ``add_request`` with ``max_tokens=1``: the prompt is matched against
     prefill's own radix cache, only the rest is computed (chunked), and the
     first token is sampled with the request's own sampling settings — the
     draw depends only on (seed, position), so every stage agrees;
  2. the first token is reported at once (it is the user's TTFT);
  3. the KV leaves the engine in the canonical wire format and goes, at the
     same time, (a) in full to the relay over the fast link (P-RLD-MD only)
     and (b) from ``main_decode_cached_tokens`` on — only what MainDecode's
     DRC lacks — over the WAN as a resumable ``PushKv`` stream, waiting for a
     slot of the link's bounded stream pool; both pushes start before the
     prompt is computed and are fed as each chunk of it is: the engine thread
     exports what each step computed into the links' buffers right after the
     step (``pdd.serving.prefill_feed``). A WAN link is one per remote cluster
     (``job.main_decode_cluster``): its pools (one per lane) and its meter
     (``pdd.kv.link_meter``: throughput, bytes queued and in flight, RTT by
     a periodic health check to the cluster's MainDecode, health) are keyed
     by cluster, and its ``LinkState`` goes out with every load report;
  4. the request's KV is released as soon as it is exported (its prompt
     blocks stay in the radix cache for the next turn), and ``TransferDone``
     reports bytes and times.
Prefill reaches MainDecode and the relay through ``PrefillPeers`` (typed clients over
``Channels`` by default; in-process peers in tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from pdd.core.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from pdd.core.link_state import LinkState
from pdd.core.pipeline import Pipeline
from pdd.core.stage_events import FAST_LINK_FAILED, FirstToken, PrefillJob, TransferDone
from pdd.engine.engine import StepOutput
from pdd.engine.protocol import EngineBackend
from pdd.kv.fast_link.region import Completion, PrepareRequest, Reservation
from pdd.kv.fast_link.select import usable_candidates
from pdd.kv.fast_link.sender import FastLinkSender
from pdd.kv.fast_link.shm import ShmSenderBackend
from pdd.kv.fast_link.state import TransferState, Transport
from pdd.kv.fast_link.tcp import TcpSenderBackend
from pdd.kv.layout import KvDtype
from pdd.kv.link_meter import LinkMeterConfig, LinkMeters
from pdd.kv.stream_pool import StreamPool
from pdd.kv.transfer import DEFAULT_CHUNK_BYTES, Compression
from pdd.kv.wan import KvPusher, PushReport
from pdd.serving.admission import Admission, AdmissionConfig
from pdd.serving.channels import Channels
from pdd.serving.engine_instance import EngineInstance
from pdd.serving.kv_bridge import range_header
from pdd.serving.link_prober import LinkProbe, LinkProber
from pdd.serving.mailbox import StepFailed
from pdd.serving.prefill_feed import KvFeed, KvLink
from pdd.telemetry import metrics
from pdd.wire.kv_clients import FastLinkClient, KvPushClient
from pdd.wire.link_probe import LinkProbeClient

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
    # Seconds between two RTT probes of each WAN link.
    link_probe_interval_s: float = 1.0
    # A probe unanswered this long marks its link unhealthy (until one is answered).
    link_probe_deadline_s: float = 2.0
    # Consecutive failed pushes after which a link is unhealthy.
    link_max_failures: int = 3
    # How long a request opened without MainDecode's count waits for ``bind`` after its prompt
    # is computed (the gateway binds it when MainDecode accepts: one WAN round trip).
    bind_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.wan_streams < 1:
            raise ValueError(f"wan_streams: must be >= 1, got {self.wan_streams}")
        if self.link_probe_interval_s <= 0:
            raise ValueError(
                f"link_probe_interval_s: must be positive, got {self.link_probe_interval_s}"
            )
        if self.link_probe_deadline_s <= 0:
            raise ValueError(
                f"link_probe_deadline_s: must be positive, got {self.link_probe_deadline_s}"
            )
        if self.link_max_failures < 1:
            raise ValueError(f"link_max_failures: must be >= 1, got {self.link_max_failures}")
        if self.bind_timeout_s <= 0:
            raise ValueError(f"bind_timeout_s: must be positive, got {self.bind_timeout_s}")
        if self.wan_chunk_bytes < 1024:
            raise ValueError(f"wan_chunk_bytes: must be >= 1024, got {self.wan_chunk_bytes}")


def offered_transports(preference: str, same_host: bool) -> tuple[Transport, ...]:
    """The fast-link transports prefill offers the relay, best first: probed once, logged."""
    offered = usable_candidates(preference, same_host)
    log.info("fast_link_transports", offered=[t.value for t in offered], same_host=same_host)
    return offered


# --- peers ----------------------------------------------------------------------------------


class MainDecodePeer(Protocol):
    """What prefill asks of a MainDecode (``pdd.wire.kv_clients.KvPushClient``)."""

    def kv_pusher(self, pool: StreamPool) -> KvPusher: ...


class RelayPeer(Protocol):
    """What prefill asks of a relay (``pdd.wire.kv_clients.FastLinkClient``)."""

    async def prepare_transfer(self, request: PrepareRequest) -> Reservation: ...

    async def complete_transfer(self, completion: Completion) -> bool: ...

    def tcp_backend(self) -> TcpSenderBackend: ...


@dataclass(frozen=True)
class PrefillPeers:
    """How prefill reaches its peers: MainDecode by (address, lane), the relay by address; the
    WAN links' RTT probe by MainDecode address (None: links are not probed)."""

    main_decode: Callable[[str, str], MainDecodePeer]
    relay: Callable[[str], RelayPeer]
    probe: Callable[[str], LinkProbe] | None = None

    @classmethod
    def over(cls, channels: Channels) -> PrefillPeers:
        """Typed gRPC clients on ``channels`` (one connection per address and lane)."""
        return cls(
            lambda address, lane: KvPushClient(channels.get(address, lane)),
            lambda address: FastLinkClient(channels.get(address)),
            # NOTE: a lane of its own: the probe crosses the link's shared bandwidth, but never
            # waits behind megabytes of KV already in a push's connection.
            lambda address: LinkProbeClient(channels.get(address, "probe")),
        )


# --- one request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _FastLinkSent:
    """What the fast link to the relay carried (nothing, and transport "failed", if it broke)."""

    kv_bytes: int = 0
    elapsed_s: float = 0.0
    transport: str = ""


class Prefill:
    def __init__(
        self,
        instance: EngineInstance,
        channels: Channels | None = None,
        config: PrefillConfig = PrefillConfig(),
        *,
        peers: PrefillPeers | None = None,
        admission: AdmissionConfig = AdmissionConfig(),
    ) -> None:
        """``peers``: default, typed gRPC clients over ``channels``. ``admission``: the bounds of
        what is prefilled at once (``pdd.serving.admission``)."""
        if peers is None:
            if channels is None:
                raise ValueError("channels: required unless peers are given")
            peers = PrefillPeers.over(channels)
        self.instance = instance
        self.peers = peers
        self.config = config
        self._pools: dict[tuple[str, str], StreamPool] = {}
        self._active: set[str] = set()
        # Requests opened without MainDecode's count: (prompt length, the count once bound).
        self._binds: dict[str, tuple[int, asyncio.Future]] = {}
        self.links = LinkMeters(LinkMeterConfig(max_failures=config.link_max_failures))
        self.prober = (
            None
            if peers.probe is None
            else LinkProber(
                self.links,
                peers.probe,
                interval_s=config.link_probe_interval_s,
                deadline_s=config.link_probe_deadline_s,
            )
        )
        # NOTE: the links' states go out with every load report (membership's heartbeat).
        instance.link_states = self.link_states
        self.transports = offered_transports(config.fast_link, config.relay_same_host)
        # NOTE: one for the process: it keeps the relays' segments mapped for their reuse.
        self._shm = ShmSenderBackend()
        self.admission = Admission.for_engine("prefill", admission, lambda: self.engine)

    @property
    def runner(self):
        return self.instance.runner

    def link_states(self) -> tuple[LinkState, ...]:
        """Each WAN link's measured state (one per remote cluster pushed to), gauges updated."""
        states = self.links.states()
        for st in states:
            metrics.LINK_THROUGHPUT.labels(st.cluster).set(st.throughput_bps)
            metrics.LINK_QUEUED.labels(st.cluster).set(st.queued_bytes)
            metrics.LINK_RTT.labels(st.cluster).set(st.rtt_s)
        return states

    async def close(self) -> None:
        """Stop probing the links; unmap the relays' segments."""
        if self.prober is not None:
            await self.prober.close()
        self._shm.close()

    @property
    def engine(self) -> EngineBackend:
        """The engine, through its boundary only (``pdd.engine.protocol``): ours or vLLM's."""
        assert self.instance.engine is not None, "EngineInstance.start() was not awaited"
        return self.instance.engine

    async def prefill(self, job: PrefillJob) -> AsyncIterator[FirstToken | TransferDone]:
        self._check(job)
        rid, n = job.request_id, len(job.prompt_token_ids)
        # NOTE: before any work: a refusal leaves nothing behind (prefill holds the prompt only).
        ticket = self.admission.admit(rid, n)
        self._active.add(rid)
        queue = self.runner.open(rid)
        loop = asyncio.get_running_loop()
        wan: asyncio.Future = loop.create_future()
        feed, fast, joining = self._feed(job, wan)
        self.runner.after_step(rid, feed.after_step)
        first: asyncio.Future = loop.create_future()
        # NOTE: both pushes start now and stream each chunk of the prompt as soon as it is
        # computed (the WAN push once MainDecode's count is bound, from what was computed by then).
        tasks = [asyncio.create_task(self._push_wan(job, wan, first))]
        if fast is not None:
            tasks.append(asyncio.create_task(self._send_fast(job, fast, first)))
        held = finished = False
        try:
            t0 = time.perf_counter()
            # NOTE: held from before the admission: cancelled while the engine thread adds the
            # request (a refusal elsewhere stops the call within ms), it must still be dropped.
            held = True
            cached = await self._admit(job)
            out = await self._compute(job, queue)
            prefill_ms = (time.perf_counter() - t0) * 1000
            log.info(
                "prefilled", prompt_tokens=n, cached_tokens=cached, prefill_ms=round(prefill_ms, 2)
            )
            first.set_result((out.token_id,))
            # NOTE: the token leaves first: the step's export runs after the step's outputs were
            # handed over (``EngineLoop.after_step``), never in front of them.
            yield FirstToken(
                out.token_id, n, cached, prefill_ms, out.logprob, out.prompt_logprobs or ()
            )
            await self._await_bound(job, joining)  # NOTE: the KV stays in the engine until then
            await self.runner.call(self._settle, feed)
            held = False
            done = await self._transfer_done(job, tasks)
            finished = True
            yield done
        finally:
            ticket.release()
            if joining is not None:
                joining.cancel()  # NOTE: a no-op once done
            self._close(rid, tasks, first, held=held, finished=finished)

    # --- the steps of a request's life --------------------------------------------------------

    def bind(self, request_id: str, main_decode_cached_tokens: int) -> None:
        """MainDecode accepted the request holding ``main_decode_cached_tokens`` prompt tokens:
        its WAN push starts there (a request opened with the count unknown)."""
        if (entry := self._binds.get(request_id)) is None:
            if request_id in self._active:
                raise FailedPreconditionError(
                    f"request {request_id!r} has MainDecode's cached tokens already"
                )
            raise NotFoundError(f"request {request_id!r} is not being prefilled here")
        n, bound = entry
        if not 0 <= main_decode_cached_tokens <= n:
            raise InvalidArgumentError("main_decode_cached_tokens", f"must be in [0, {n}]")
        del self._binds[request_id]
        bound.set_result(main_decode_cached_tokens)

    def _check(self, job: PrefillJob) -> None:
        n, cached = len(job.prompt_token_ids), job.main_decode_cached_tokens
        if cached is not None and not 0 <= cached <= n:
            raise InvalidArgumentError("main_decode_cached_tokens", f"must be in [0, {n}]")
        if job.pipeline is Pipeline.P_RLD_MD and job.relay is None:
            raise InvalidArgumentError("relay", "is required for the P-RLD-MD pipeline")
        if job.request_id in self._active:
            raise InvalidArgumentError(
                "request_id", f"{job.request_id!r} is already being prefilled here"
            )

    def _feed(
        self, job: PrefillJob, wan: asyncio.Future
    ) -> tuple[KvFeed, KvLink | None, asyncio.Task | None]:
        """The request's feed; the relay's link (P-RLD-MD: the whole prompt); the task that joins
        the WAN link once MainDecode's count is bound (None: known now, ``wan`` has it)."""
        rid, n = job.request_id, len(job.prompt_token_ids)
        links: list[KvLink] = []
        fast = None
        if job.pipeline is Pipeline.P_RLD_MD:
            fast = KvLink(
                range_header(self.engine, rid, 0, n, job.prompt_token_ids, job.cache_salt)
            )
            links.append(fast)
        known = job.main_decode_cached_tokens is not None
        if known:
            links.append(self._wan_link(job, job.main_decode_cached_tokens))
            wan.set_result(links[-1])
        feed = KvFeed(self.engine, rid, n, tuple(links), self.runner.call_threadsafe)
        if known:
            return feed, fast, None
        bound = asyncio.get_running_loop().create_future()
        self._binds[rid] = (n, bound)
        return feed, fast, asyncio.create_task(self._join_wan(job, feed, bound, wan))

    def _wan_link(self, job: PrefillJob, start: int) -> KvLink:
        """The WAN delta: prompt tokens ``[start, n)``, in the link's wire dtype and chunks."""
        cfg = self.config
        header = range_header(
            self.engine,
            job.request_id,
            start,
            len(job.prompt_token_ids),
            job.prompt_token_ids,
            job.cache_salt,
            wire_dtype=cfg.wan_dtype,
            compression=cfg.wan_compression,
            chunk_bytes=cfg.wan_chunk_bytes,
        )
        return KvLink(header)

    async def _join_wan(
        self, job: PrefillJob, feed: KvFeed, bound: asyncio.Future, wan: asyncio.Future
    ) -> None:
        """Once MainDecode's count is bound the WAN link joins the feed, taking at once what was
        computed from that count on (the engine still holds it)."""
        start = await bound
        link = self._wan_link(job, start)
        await self.runner.call(feed.join, link)
        wan.set_result(link)
        log.info("main_decode_bound", cached_tokens=start, computed=feed.exported)

    async def _await_bound(self, job: PrefillJob, joining: asyncio.Task | None) -> None:
        """The prompt is computed: wait (``bind_timeout_s``) for MainDecode's count if it has not
        come yet, and for the WAN link to take what it lacks."""
        if joining is None:
            return
        try:
            async with asyncio.timeout(self.config.bind_timeout_s):
                await asyncio.shield(joining)
        except TimeoutError:
            raise DeadlineExceededError(
                f"main_decode_cached_tokens of {job.request_id!r} were not bound within "
                f"{self.config.bind_timeout_s:g} s"
            ) from None

    async def _admit(self, job: PrefillJob) -> int:
        """Add the request (one output, kept after finishing for export); its prefix hit."""
        rid = job.request_id

        def admit() -> int:
            self.engine.add_request(
                rid,
                job.prompt_token_ids,
                replace(job.sampling, max_tokens=1),
                salt=job.cache_salt,
                keep_after_finish=True,
            )
            return self.engine.num_cached_tokens(rid)

        self.runner.expect(job.burst_following)
        cached = await self.runner.call(admit)
        metrics.PREFIX_QUERIES.labels("prefill").inc(len(job.prompt_token_ids))
        metrics.PREFIX_HITS.labels("prefill").inc(cached)
        return cached

    async def _compute(self, job: PrefillJob, queue: asyncio.Queue) -> StepOutput:
        """The sampled first token's output (the feed exports each computed part meanwhile)."""
        item = await queue.get()
        match item:
            case StepOutput():
                return item
            case StepFailed(error=error):
                raise error
        raise TypeError(f"unexpected item on {job.request_id}'s queue: {item!r}")

    def _settle(self, feed: KvFeed) -> None:
        """The prompt is computed (engine thread): every link has all of it — a no-op once the
        last step's export ran —, and the engine lets the request go (its prompt blocks stay in
        the radix cache for the next turn)."""
        feed.export_upto(feed.prompt_len)
        self.engine.release(feed.request_id)

    async def _transfer_done(self, job: PrefillJob, tasks: list[asyncio.Task]) -> TransferDone:
        # NOTE: both links run to their end before either's failure counts: a lost MainDecode
        # must not cut the relay's KV short (the relay decodes on alone while the gateway
        # re-homes the request), nor a lost relay MainDecode's.
        wan, *fast_sent = await asyncio.gather(*tasks, return_exceptions=True)
        fast = _FastLinkSent()
        if fast_sent and isinstance(exc := fast_sent[0], BaseException):
            # NOTE: a lost relay must not fail the request: MainDecode has its KV over the
            # WAN, and the gateway hands the tokens it streamed over to MainDecode itself.
            log.warning(
                "fast_link_failed",
                relay=job.relay.instance_id if job.relay else "",
                error=f"{type(exc).__name__}: {exc}",
            )
            fast = _FastLinkSent(transport=FAST_LINK_FAILED)
        elif fast_sent:
            fast = fast_sent[0]
        if isinstance(wan, BaseException):
            raise wan
        return TransferDone(
            fast.kv_bytes,
            wan.wire_bytes,
            fast.elapsed_s * 1000,
            wan.elapsed_s * 1000,
            wan.queue_wait_s * 1000,
            fast.transport,
        )

    def _close(
        self,
        rid: str,
        tasks: list[asyncio.Task],
        first: asyncio.Future,
        *,
        held: bool,
        finished: bool,
    ) -> None:
        self._active.discard(rid)
        self._binds.pop(rid, None)
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

    # --- the two links ------------------------------------------------------------------------

    def _pool(self, cluster: str, lane: str) -> StreamPool:
        # NOTE: per (cluster, lane), not per MainDecode: the report's connection pool bounds the
        # pushes over one inter-cluster link, whichever of its MainDecodes they go to.
        pool = self._pools.get((cluster, lane))
        if pool is None:
            pool = self._pools[cluster, lane] = StreamPool(self.config.wan_streams)
            metrics.LIVE.watch_pool(pool)
        return pool

    async def _push_wan(
        self, job: PrefillJob, wan: asyncio.Future, first: asyncio.Future
    ) -> PushReport:
        link: KvLink = await wan
        header = link.header
        address, cluster = job.main_decode.address, job.main_decode_cluster
        # NOTE: P-MD deltas are small and on the user's critical path (MainDecode decodes every
        # token); P-RLD-MD deltas are bulk that the relay hides. Separate lanes, separate pools.
        lane = "urgent" if job.pipeline is Pipeline.P_MD else "bulk"
        pusher = self.peers.main_decode(address, lane).kv_pusher(self._pool(cluster, lane))
        if self.prober is not None:
            self.prober.target(cluster, address)
        with self.links.meter(cluster).push(header.total_bytes) as metered:
            report = await pusher.push(header, metered.source(link.source), output_token_ids=first)
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

    async def _send_fast(
        self, job: PrefillJob, link: KvLink, first: asyncio.Future
    ) -> _FastLinkSent:
        assert job.relay is not None
        header = link.header
        relay = self.peers.relay(job.relay.address)
        request = PrepareRequest(
            job.request_id, header.layout, header.num_tokens, header.total_bytes, self.transports
        )
        reservation = await relay.prepare_transfer(request)
        sender = FastLinkSender([self._shm, relay.tcp_backend()])
        t0 = time.perf_counter()
        report = await sender.send(reservation, header, link.source, relay.complete_transfer, first)
        if report.state is not TransferState.COMPLETED:
            raise FailedPreconditionError(
                f"fast link to {job.relay.instance_id} failed: {report.state.value}"
            )
        elapsed, transport = time.perf_counter() - t0, reservation.transport.value
        metrics.FAST_LINK_BYTES.labels(transport).inc(header.total_bytes)
        metrics.FAST_LINK_TRANSFER.labels(transport).observe(elapsed)
        return _FastLinkSent(header.total_bytes, elapsed, transport)
