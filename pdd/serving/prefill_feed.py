"""A prefill request's outgoing KV while it is computed: the links it is exported into.

Each link is one range of the prompt bound for one peer (the whole prompt to the relay, the delta
MainDecode lacks over the WAN), with the buffer its push reads (``FilledSource``). The feed is
exported on the engine thread right after every step (``EngineLoop.after_step``): what the step
computed goes into every link's buffer before the next step starts, so a push never waits behind
a step it has nothing to do with. The WAN link may join late, once the gateway binds
MainDecode's cached count: it then first takes what was computed before (``join``, also on the
engine thread, so it is ordered with the steps' exports).

NOTE: the feed's state (``links``, ``exported``) and each link's ``filled`` are the engine
thread's: written there only. A buffer's readers are woken on the event loop: every export
posts its ``advance`` there, after the bytes are written.
"""

from __future__ import annotations

from collections.abc import Callable

from pdd.engine.protocol import EngineBackend
from pdd.kv.source import FilledSource
from pdd.kv.transfer import TransferHeader
from pdd.serving.kv_bridge import export_tokens, write_wire

Post = Callable[[Callable[[], None]], None]


class KvLink:
    """One outgoing KV range: its header and the buffer prefill exports it into as it computes."""

    def __init__(self, header: TransferHeader) -> None:
        self.header = header
        self.source = FilledSource(header.total_bytes)
        self.filled = 0  # NOTE: bytes written (engine thread); ``source.produced`` follows

    def fill(self, kv_token_major, start: int) -> int:
        """Tokens ``[start, start + len(kv))`` were computed: write the part inside this range
        into the buffer in the wire dtype, after what is already there (engine thread)."""
        kv = kv_token_major[max(start, self.header.start_token) - start :]
        nbytes = self.header.layout.nbytes(kv.shape[0])
        if nbytes:
            write_wire(kv, self.header.layout, self.source.region(self.filled, nbytes))
            self.filled += nbytes
        return nbytes


class KvFeed:
    """A request's links and how far its prompt was exported into them (``exported`` tokens of
    ``prompt_len``). ``post(fn)`` runs ``fn`` on the event loop (``EngineLoop.call_threadsafe``)."""

    def __init__(
        self,
        engine: EngineBackend,
        request_id: str,
        prompt_len: int,
        links: tuple[KvLink, ...],
        post: Post,
    ) -> None:
        self.engine, self.request_id, self.prompt_len = engine, request_id, prompt_len
        self.links = links
        self.post = post
        self.exported = 0
        self.error: Exception | None = None  # NOTE: an export failed: the feed is over

    def after_step(self) -> None:
        """Export what the last step computed (engine thread, between two steps)."""
        if self.error is None and self.exported < self.prompt_len:
            if self.engine.holds_request(self.request_id):
                self.export_upto(self.engine.num_cached_tokens(self.request_id))

    def export_upto(self, upto: int) -> None:
        """Export tokens ``[exported, upto)`` into every link joined so far (engine thread)."""
        if self.error is not None:
            raise self.error
        upto = min(upto, self.prompt_len)
        if upto > self.exported:
            self._export(self.exported, upto, self.links)
            self.exported = upto

    def join(self, link: KvLink) -> None:
        """``link`` joins the feed, first taking what was computed before (engine thread)."""
        if self.error is not None:
            raise self.error
        if self.exported > link.header.start_token:
            self._export(link.header.start_token, self.exported, (link,))
        self.links = (*self.links, link)

    def _export(self, start: int, end: int, links: tuple[KvLink, ...]) -> None:
        try:
            kv = export_tokens(self.engine, self.request_id, start, end)  # [n, L, 2, KV, D]
            for link in links:
                nbytes = link.fill(kv, start)
                self.post(lambda src=link.source, n=nbytes: src.advance(n))
        except Exception as exc:  # noqa: BLE001 — the pushes reading these buffers fail with it
            self.error = exc
            for link in (*self.links, *(x for x in links if x not in self.links)):
                self.post(lambda src=link.source, e=exc: src.fail(e))
            raise
