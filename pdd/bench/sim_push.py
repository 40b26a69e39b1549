"""One request's KV on its way out of prefill, fed chunk by chunk as prefill computes it.

The live prefill exports each chunk's KV as it lands and streams it at once: over the WAN only the
delta MainDecode lacks (``[main_decode_cached, n)``), over the fast link the whole prompt to the
relay (or the delta to IDC-PD's decoder). What prefill's own cache already held goes first. So a
long prefill overlaps its own transfer, and only the last chunk's KV is left to send when it ends.

``WanPush`` sends through a ``SimLink`` (the remote cluster's pool, shared with every other push):
whatever has been computed and not yet sent goes as one transfer; chunks computed meanwhile wait for
it and go as the next. NOTE: between two transfers the request gives its pool slot back (the live
pusher keeps its stream), so under a full pool a streamed push can queue more than once.
``FastPush`` is a dedicated fast link per request (no sharing: the report's RDMA takes "tens of ms").
Both call ``landed`` once, when the last byte is across; ``close`` says prefill is done.
"""

from __future__ import annotations

from collections.abc import Callable

from pdd.bench.sim_link import EventLoop, SimLink


class WanPush:
    def __init__(
        self,
        loop: EventLoop,
        link: SimLink,
        bytes_per_token: float,
        start: int,
        landed: Callable[[], None],
    ) -> None:
        self.loop, self.link, self.kv, self.landed = loop, link, bytes_per_token, landed
        self.sent_to = start  # prompt position up to which KV is handed to the link
        self.total = 0.0  # the delta's bytes, once known (``expect``): the link's outstanding
        self.pending = 0.0
        self.busy = self.closed = self.over = False
        self.queue = self.flight = 0.0  # seconds waiting for a pool slot / on the wire, summed

    def expect(self, nbytes: float) -> None:
        """The push registers its whole delta with the link (the router sees it outstanding)."""
        self.total = nbytes
        self.link.outstanding += nbytes

    def feed(self, upto: int) -> None:
        """Prefill holds the prompt's KV up to position ``upto``."""
        if upto > self.sent_to:
            self.pending += (upto - self.sent_to) * self.kv
            self.sent_to = upto
        self._send()

    def close(self) -> None:
        self.closed = True
        self._send()

    def _send(self) -> None:
        if self.busy or self.over:
            return
        if self.pending > 0:
            nbytes, self.pending, self.busy = self.pending, 0.0, True
            self.link.submit(nbytes, lambda q, f: self._sent(q, f, nbytes))
        elif self.closed:
            self.over = True
            self.landed()

    def _sent(self, queue: float, flight: float, nbytes: float) -> None:
        moved = min(nbytes, self.total)
        self.total -= moved
        self.link.outstanding -= moved
        self.queue += queue
        self.flight += flight
        self.busy = False
        self._send()


class FastPush:
    def __init__(
        self, loop: EventLoop, bytes_per_s: float, bytes_per_token: float, start: int, landed
    ) -> None:
        self.loop, self.rate, self.kv, self.landed = loop, bytes_per_s, bytes_per_token, landed
        self.sent_to = start
        self.free_at = loop.now  # when the request's link has sent everything fed so far

    def feed(self, upto: int) -> None:
        if upto > self.sent_to:
            now = self.loop.now
            self.free_at = max(self.free_at, now) + (upto - self.sent_to) * self.kv / self.rate
            self.sent_to = upto

    def close(self) -> None:
        self.loop.at(self.free_at, self.landed)
