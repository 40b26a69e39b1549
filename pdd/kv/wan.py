"""The WAN KV sender: resumable chunked pushes over ``MainDecodeService/PushKv``.

Life of a push (``KvPusher.push``):

1. once its first chunk can be read, wait for a slot in the link's ``StreamPool`` (FIFO; the
   wait is measured): a push whose prompt is still being computed holds no slot, so the pushes
   of prompts already computed are not queued behind it (measured: a burst of 32 over three
   prefill steps, the last step's pushes held all 4 slots ~370 ms while 16 computed requests
   waited);
2. open a ``PushKv`` stream: header, then chunks read lazily from the
   ``KvSource`` — at most ``max_buffered_chunks`` encoded ahead of the wire, so
   a producer still computing later layers is never outrun by more than that —
   then the commit;
3. the response lists missing chunks (bad checksum, ...) → a new stream resends
   exactly those (header, missing chunks, commit);
4. a stream that breaks mid-way (a retryable gRPC status, or the call cancelled
   under us) → ask ``GetKvTransfer`` what arrived and resume with only the
   missing chunks;
5. up to ``max_retries`` extra streams, with exponential backoff, then
   ``UnavailableError``. Non-retryable statuses become domain errors at once.

The receiving side is ``pdd.kv.receiver.KvReceiver`` (re-exported here with
the ``StreamPool`` so that ``pdd.kv.wan`` is the WAN link's whole surface).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc
import structlog

from pdd.core import errors
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as mdpb
from pdd.gen.main_decode.v1 import main_decode_service_pb2_grpc as mdgrpc
from pdd.kv import messages as convert
from pdd.kv.chunking import encode_chunk
from pdd.kv.push_codec import push_kv_call
from pdd.kv.receiver import KvReceiver, ReceivedKv, ReceiverConfig
from pdd.kv.source import KvSource
from pdd.kv.stream_pool import StreamPool
from pdd.kv.transfer import (
    Chunk,
    Commit,
    Compression,
    PushItem,
    TransferHeader,
    TransferStatus,
    chunk_span,
)

__all__ = [
    "KvPusher",
    "PusherConfig",
    "PushReport",
    "StreamPool",
    "KvReceiver",
    "ReceiverConfig",
    "ReceivedKv",
]

log = structlog.get_logger(__name__)

# NOTE: a push's requests are domain items; the call encodes them (``push_codec``).
PushFn = Callable[[AsyncIterator[PushItem]], Awaitable[mdpb.PushKvResponse]]
GetTransferFn = Callable[[str], Awaitable[mdpb.GetKvTransferResponse]]

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: lambda m: errors.InvalidArgumentError("push", m),
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPreconditionError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
}
_END = object()


@dataclass(frozen=True)
class PusherConfig:
    # Extra streams after the first (resends and resumes).
    max_retries: int = 3
    # Encoded chunks prepared ahead of the wire (back-pressure bound).
    max_buffered_chunks: int = 4
    backoff_s: float = 0.05
    backoff_max_s: float = 1.0
    zlib_level: int = 1
    retry_codes: frozenset[grpc.StatusCode] = RETRYABLE

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        if self.max_buffered_chunks < 1:
            raise ValueError(f"max_buffered_chunks: must be >= 1, got {self.max_buffered_chunks}")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("backoff_s: must be >= 0 and <= backoff_max_s")
        if not 0 <= self.zlib_level <= 9:
            raise ValueError(f"zlib_level: must be in [0, 9], got {self.zlib_level}")


@dataclass(frozen=True)
class PushReport:
    request_id: str
    # Streams opened (1 when nothing went wrong).
    attempts: int
    chunks_sent: int
    chunks_resent: int
    # Chunk payload bytes put on the wire, resends included.
    wire_bytes: int
    queue_wait_s: float
    # From holding a slot to the receiver confirming completion.
    elapsed_s: float


@dataclass
class _Tally:
    chunks: int = 0
    wire_bytes: int = 0
    source_error: BaseException | None = field(default=None, repr=False)


class KvPusher:
    def __init__(
        self,
        push: PushFn,
        get_transfer: GetTransferFn,
        *,
        config: PusherConfig = PusherConfig(),
        pool: StreamPool | None = None,
    ) -> None:
        self._push = push
        self._get_transfer = get_transfer
        self.config = config
        self.pool = pool

    @classmethod
    def for_channel(
        cls,
        channel: grpc.aio.Channel,
        *,
        config: PusherConfig = PusherConfig(),
        pool: StreamPool | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> KvPusher:
        """A pusher to the ``MainDecodeService`` on ``channel`` (``grpc.aio``)."""
        stub = mdgrpc.MainDecodeServiceStub(channel)

        async def get_transfer(request_id: str) -> mdpb.GetKvTransferResponse:
            req = mdpb.GetKvTransferRequest(request_id=request_id)
            return await stub.GetKvTransfer(req, metadata=metadata)

        return cls(push_kv_call(channel, metadata), get_transfer, config=config, pool=pool)

    async def push(
        self,
        header: TransferHeader,
        source: KvSource,
        output_token_ids: Sequence[int] | asyncio.Future = (),
    ) -> PushReport:
        """Push ``header``'s range from ``source``; the commit carries ``output_token_ids``.

        ``output_token_ids`` may be a future (prefill pushes while still computing, before its
        first token is sampled); it is awaited only when the commit is due.
        """
        if source.total_bytes != header.total_bytes:
            raise errors.InvalidArgumentError(
                "source", f"holds {source.total_bytes} bytes, header says {header.total_bytes}"
            )
        if header.num_chunks:
            await source.ready(chunk_span(header, 0)[1])  # NOTE: sendable before it holds a slot
        slot = self.pool.slot() if self.pool is not None else _no_wait()
        async with slot as waited:
            start = time.monotonic()
            attempts, tally = await self._push_until_complete(header, source, output_token_ids)
            report = PushReport(
                header.request_id,
                attempts,
                tally.chunks,
                max(0, tally.chunks - header.num_chunks),
                tally.wire_bytes,
                waited,
                time.monotonic() - start,
            )
        log.info(
            "kv_push_complete",
            request_id=header.request_id,
            bytes=header.total_bytes,
            attempts=attempts,
            resent=report.chunks_resent,
            queue_wait_s=round(waited, 4),
            elapsed_s=round(report.elapsed_s, 4),
        )
        return report

    async def _push_until_complete(
        self, header: TransferHeader, source: KvSource, commit: Sequence[int] | asyncio.Future
    ) -> tuple[int, _Tally]:
        tally = _Tally()
        todo: list[int] = list(range(header.num_chunks))
        for attempt in range(1, self.config.max_retries + 2):
            broken = ""
            try:
                status = await self._stream(header, source, todo, commit, tally)
            except grpc.aio.AioRpcError as e:
                if tally.source_error is not None:
                    raise tally.source_error from e
                if e.code() not in self.config.retry_codes:
                    raise _ERRORS.get(e.code(), errors.UnavailableError)(
                        e.details() or e.code().name
                    ) from e
                broken = e.code().name
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # we are being cancelled, not just the call
                broken = "CANCELLED"
            if tally.source_error is not None:
                raise tally.source_error
            if not broken:
                if status.complete:
                    return attempt, tally
                todo = list(status.missing)
            if attempt > self.config.max_retries:
                break
            await asyncio.sleep(
                min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
            )
            if broken:
                resumed = await self._still_missing(header.request_id, header.num_chunks)
                if resumed is not None and resumed.complete:
                    return attempt, tally  # everything landed; only the response was lost
                if resumed is not None:
                    todo = list(resumed.missing)
            log.info(
                "kv_push_retry",
                request_id=header.request_id,
                attempt=attempt,
                broken=broken or None,
                resend=len(todo),
            )
        raise errors.UnavailableError(
            f"KV push of {header.request_id} incomplete after {self.config.max_retries + 1} streams"
        )

    async def _still_missing(self, request_id: str, num_chunks: int) -> TransferStatus | None:
        """What the receiver lacks after a broken stream; None if it cannot tell (resend as before)."""
        try:
            status = convert.transfer_status_from_pb(
                request_id, await self._get_transfer(request_id)
            )
        except grpc.aio.AioRpcError as e:
            log.info("kv_get_transfer_failed", request_id=request_id, code=e.code().name)
            return None
        if not status.known:  # the header never arrived (or the receiver forgot): everything
            return TransferStatus(request_id, False, num_chunks, tuple(range(num_chunks)))
        return status

    async def _stream(
        self,
        header: TransferHeader,
        source: KvSource,
        indices: list[int],
        commit: Sequence[int] | asyncio.Future,
        tally: _Tally,
    ) -> TransferStatus:
        requests = self._requests(header, source, indices, commit, tally)
        try:
            response = await self._push(requests)
        finally:
            with contextlib.suppress(RuntimeError):  # still being iterated by gRPC's consumer task
                await requests.aclose()
        return convert.push_response_from_pb(response)

    async def _requests(
        self,
        header: TransferHeader,
        source: KvSource,
        indices: list[int],
        commit: Sequence[int] | asyncio.Future,
        tally: _Tally,
    ) -> AsyncIterator[PushItem]:
        yield header
        queue: asyncio.Queue[object] = asyncio.Queue(maxsize=self.config.max_buffered_chunks)
        encoder = asyncio.create_task(self._encode(header, source, indices, queue))
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    tally.source_error = item
                    raise item
                chunk = cast(Chunk, item)
                tally.chunks += 1
                tally.wire_bytes += len(chunk.data)
                yield chunk
            ids = await commit if isinstance(commit, asyncio.Future) else commit
            yield Commit(header.request_id, tuple(ids))
        finally:
            encoder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await encoder

    async def _encode(
        self,
        header: TransferHeader,
        source: KvSource,
        indices: list[int],
        queue: asyncio.Queue[object],
    ) -> None:
        level = self.config.zlib_level
        try:
            for index in indices:
                offset, length = chunk_span(header, index)
                raw = await source.read(offset, length)
                if header.compression is Compression.NONE:
                    chunk = encode_chunk(header, index, raw)
                else:  # zlib on a MiB takes milliseconds: keep the event loop free
                    chunk = await asyncio.to_thread(encode_chunk, header, index, raw, level=level)
                await queue.put(chunk)
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — surfaced by the request generator
            await queue.put(e)


@contextlib.asynccontextmanager
async def _no_wait() -> AsyncIterator[float]:
    yield 0.0
