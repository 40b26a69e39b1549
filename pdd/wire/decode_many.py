"""MainDecode's ``DecodeMany``: many requests' ``Decode`` on one stream, their events joined.

Life of a stream: the gateway writes ``DecodeManyRequest`` s — start call N with a job, or cancel
call N. Each start runs the role's own ``decode(job)`` (the request life ``Decode`` runs) in a
task of its own, under the call's deadline, putting its events on one outgoing queue; the writer
takes everything queued at that moment and sends it as one ``DecodeManyResponse``. An engine step
hands its outputs to every running request at once, so what one step made for all of them goes
out as one message (``Decode`` sends one per request per step; the gateway's cost is per
message). A call ends with a ``DecodeEnd``: OK after its last event, or the status its ``Decode``
would have ended with (the one mapping, ``pdd.server.errors``); a cancel or a deadline ends the
task, and the role frees what the request held as when a ``Decode`` call is cancelled.

The stream itself ends when the gateway has stopped writing and every call it started has ended;
a message that does not parse, or a call id reused while its call runs, ends it with
INVALID_ARGUMENT (the gateway is the only writer: that is a broken peer, not a bad request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from pdd.core.errors import InvalidArgumentError, UnavailableError
from pdd.core.stage_events import DecodeEvent, DecodeJob
from pdd.gen.main_decode.v1 import main_decode_service_pb2 as pb
from pdd.server.errors import status_for
from pdd.wire import main_decode as conv

log = structlog.get_logger(__name__)

Decode = Callable[[DecodeJob], AsyncIterator[DecodeEvent]]


@dataclass(frozen=True)
class _StreamFailed:
    """The stream itself is broken: end it with this error."""

    error: BaseException


_ALL_STARTED = object()  # the gateway stopped writing


class DecodeManyStreams:
    """The service's open ``DecodeMany`` streams, served by ``serve``; ``drain`` on shutdown."""

    def __init__(self, decode: Decode, vocab: Callable[[], int], instance_id: str) -> None:
        """``vocab``: the model's vocabulary size, asked when a call starts (the model loads
        after the servicer is made)."""
        self.decode, self.vocab, self.instance_id = decode, vocab, instance_id
        self.draining = False
        self._outs: set[asyncio.Queue] = set()

    async def drain(self) -> None:
        """Shutting down: new calls are refused (UNAVAILABLE), and each stream ends once the
        calls it runs have ended (a stream never ends by itself: without this every stop
        would wait out its whole grace period)."""
        self.draining = True
        for out in self._outs:
            out.put_nowait(_ALL_STARTED)

    async def serve(self, requests: AsyncIterator[object]) -> AsyncIterator[pb.DecodeManyResponse]:
        """The responses of one ``DecodeMany`` stream whose requests are ``requests``."""
        out: asyncio.Queue = asyncio.Queue()
        calls: dict[int, asyncio.Task] = {}
        reader = asyncio.create_task(self._read(requests, out, calls))
        self._outs.add(out)
        all_started = self.draining
        try:
            while not (all_started and not calls):
                item = await out.get()
                events: list[pb.DecodeManyEvent] = []
                while True:
                    if item is _ALL_STARTED:
                        all_started = True
                    elif isinstance(item, _StreamFailed):
                        raise item.error
                    else:
                        events.append(item)
                    if out.empty():
                        break
                    item = out.get_nowait()
                if events:
                    yield pb.DecodeManyResponse(events=events)
        finally:
            self._outs.discard(out)
            reader.cancel()
            for task in calls.values():
                task.cancel()
            await asyncio.gather(reader, *calls.values(), return_exceptions=True)

    async def _read(self, requests, out: asyncio.Queue, calls: dict[int, asyncio.Task]) -> None:
        try:
            # NOTE: a message that does not parse raises here (``decode_checked``).
            async for msg in requests:
                call_id = conv.call_id_from_pb(msg)
                try:
                    action = conv.many_request_from_pb(msg, self.vocab())
                    if self.draining and isinstance(action, conv.StartCall):
                        raise UnavailableError("main_decode is shutting down")
                except Exception as exc:  # noqa: BLE001 — a bad job ends its call, not the stream
                    if call_id not in calls:
                        out.put_nowait(conv.ended_to_pb(call_id, _end_for(exc)))
                    continue
                if isinstance(action, conv.CancelCall):
                    if (task := calls.get(call_id)) is not None:
                        task.cancel()
                    continue
                if call_id in calls:
                    raise InvalidArgumentError(
                        "call_id", f"{call_id} is already running on this stream"
                    )
                calls[call_id] = asyncio.create_task(
                    _call(action, self.decode, self.instance_id, out, calls),
                    name=f"decode-many-{action.job.request_id}",
                )
            out.put_nowait(_ALL_STARTED)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — the stream's own failure goes to its writer
            out.put_nowait(_StreamFailed(exc))


async def _call(start: conv.StartCall, decode: Decode, instance_id: str, out, calls) -> None:
    # NOTE: what Decode's interceptor binds per call, bound per task (a copy of the context).
    structlog.contextvars.bind_contextvars(request_id=start.job.request_id)
    call_id, end = start.call_id, conv.CallEnded("OK")
    t0 = time.perf_counter()
    events = decode(start.job)
    try:
        async with asyncio.timeout(start.timeout_s):
            async for ev in events:
                out.put_nowait(
                    conv.event_to_pb(ev, instance_id, pb.DecodeManyEvent, call_id=call_id)
                )
    except asyncio.CancelledError:
        end = conv.CallEnded("CANCELLED", "cancelled")
        raise
    except TimeoutError:
        end = conv.CallEnded("DEADLINE_EXCEEDED", "the call's deadline passed")
    except Exception as exc:  # noqa: BLE001 — every failure ends the call with its status
        end = _end_for(exc)
        if end.code in ("INTERNAL", "UNKNOWN"):
            log.exception("decode_many_call_failed", call_id=call_id)
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()
        calls.pop(call_id, None)
        out.put_nowait(conv.ended_to_pb(call_id, end))
        # NOTE: what the interceptor logs for a Decode call, for each call on the stream.
        ms = round((time.perf_counter() - t0) * 1000, 2)
        log.info("decode_call_finished", call_id=call_id, code=end.code, ms=ms)


def _end_for(exc: BaseException) -> conv.CallEnded:
    """How a call that raised ``exc`` ends: the status its ``Decode`` would have had."""
    code, message = status_for(exc)
    return conv.CallEnded(code.name, message)
