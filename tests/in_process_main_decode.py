"""A MainDecode in this process, answering the calls a relay makes of ``MainDecodeClient``, and
the readers of a relay's event stream.

Shared by the relay's request-life tests on our engine (tests/unit/test_relay_life.py) and on
vLLM (tests/vllm/test_vllm_relay.py): a domain error becomes the PeerError the client would raise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.core.errors import PddError, PeerError
from pdd.core.stage_events import HandoffAck, HandoffBatch, KvReadiness, Tokens
from pdd.server.errors import status_for
from pdd.serving.main_decode import MainDecode


class InProcessHandoff:
    """A handoff call answered by ``MainDecode.handoff``; its failures as the client's PeerError."""

    def __init__(self, peer: InProcessMainDecode) -> None:
        self.peer = peer
        self.finished = self.cancelled = False

    async def send(self, batch: HandoffBatch) -> HandoffAck:
        self.peer.batches.append(batch)
        try:
            return await self.peer.md.handoff(batch)
        except PddError as exc:
            code, details = status_for(exc)  # NOTE: what the servicer's status would carry
            raise PeerError(code.name, details, "main_decode") from None

    async def done(self, *, wait: bool = False) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.cancelled = True


class InProcessMainDecode:
    """``MainDecodeClient``'s calls the relay makes, answered by a MainDecode in this process."""

    def __init__(self, md: MainDecode) -> None:
        self.md = md
        self.batches: list[HandoffBatch] = []
        self.calls: list[InProcessHandoff] = []

    async def wait_kv_ready(self, request_id: str, timeout_ms: int) -> KvReadiness:
        try:
            return await self.md.wait_kv_ready(request_id, timeout_ms)
        except PddError as exc:
            code, details = status_for(exc)
            raise PeerError(code.name, details, "main_decode") from None

    def token_handoff(self) -> InProcessHandoff:
        self.calls.append(InProcessHandoff(self))
        return self.calls[-1]


def positions(events) -> dict[int, int]:
    """Output position → token of the ``Tokens`` among ``events`` (no position twice)."""
    out: dict[int, int] = {}
    for ev in events:
        if isinstance(ev, Tokens):
            for i, tok in enumerate(ev.token_ids):
                assert ev.start_position + i not in out, "a position streamed twice"
                out[ev.start_position + i] = tok
    return out


async def read_through(stream: AsyncIterator, position: int) -> list:
    """The relay's events up to (and with) the one carrying output ``position``."""
    events: list = []
    while position not in positions(events):
        events.append(await anext(stream))
    return events
