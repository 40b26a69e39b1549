"""Each WAN link's state, measured where the KV is sent: ``LinkMeter`` (one per remote cluster).

Life of a measurement:
  1. a push registers with ``meter.push(total_bytes)``: its bytes are *queued* (waiting for a
     slot of the link's stream pool);
  2. the pusher reads its source (``MeteredPush.source``) only once it holds a slot, so the
     first read moves the push *in flight*; a read's bytes count as sent when the pusher comes
     back for the next one (its queue ahead of the wire took them) or the push succeeds;
  3. throughput: bytes handed to the wire per second of *link-busy* time — time with at least
     one push in flight that is not waiting on its producer (a prefill still computing the
     prompt holds a push's reads back; that wait is the engine's, not the link's, so it is not
     counted). Folded into an EWMA over windows of at least ``window_s`` busy seconds;
  4. the push ends (``with`` exits): a failure counts toward ``max_failures`` consecutive ones
     (then the link is unhealthy), a success resets the count;
  5. RTT: the sender probes the link with a tiny call through the same path (prefill: a gRPC
     health check to a MainDecode of the cluster) and reports ``rtt(seconds)`` or, when no
     answer came within its deadline, ``rtt_timed_out()`` — unhealthy until the next answer.
``state()`` is the ``LinkState`` prefill publishes with its load report.

NOTE: in-flight bytes are a push's bytes not yet read from its source; the pusher reads a
bounded number of chunks ahead of the wire, so they undercount what is unsent by at most that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdd.core.link_state import LinkState
from pdd.kv.source import KvSource


@dataclass(frozen=True)
class LinkMeterConfig:
    # Weight of the newest throughput window in the EWMA.
    alpha: float = 0.3
    # Busy seconds a throughput window spans before it is folded in.
    window_s: float = 0.05
    # Consecutive failed pushes after which the link is unhealthy.
    max_failures: int = 3
    # Weight of the newest RTT sample.
    rtt_alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha: must be in (0, 1], got {self.alpha}")
        if self.window_s <= 0:
            raise ValueError(f"window_s: must be positive, got {self.window_s}")
        if self.max_failures < 1:
            raise ValueError(f"max_failures: must be >= 1, got {self.max_failures}")
        if not 0.0 < self.rtt_alpha <= 1.0:
            raise ValueError(f"rtt_alpha: must be in (0, 1], got {self.rtt_alpha}")


@dataclass(eq=False)
class _Push:
    total: int
    # Bytes up to the furthest read (≈ handed to the wire).
    read: int = 0
    # Whether the pusher read its source yet (it does only while holding a pool slot).
    started: bool = False
    # Bytes of the last read, credited as sent when the pusher comes back for more (it reads
    # ahead of the wire: a read's bytes are on their way, not across, when it returns).
    pending: int = 0


class LinkMeter:
    def __init__(
        self,
        cluster: str,
        config: LinkMeterConfig = LinkMeterConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.cluster = cluster
        self.config = config
        self._clock = clock
        self._wall_ms = wall_ms
        self._pushes: set[_Push] = set()
        self.throughput_bps = 0.0
        self.rtt_s = 0.0
        self.failures = 0
        self.rtt_lost = False
        self._measured_at_ms = 0
        # Pushes in flight and not waiting on their producer; busy time runs while > 0.
        self._active = 0
        self._busy_from = 0.0
        self._window_busy_s = 0.0
        self._window_bytes = 0

    # --- what senders report ------------------------------------------------------------------

    def push(self, total_bytes: int) -> MeteredPush:
        """Register a push of ``total_bytes`` (queued until its source is first read)."""
        return MeteredPush(self, total_bytes)

    def rtt(self, seconds: float) -> None:
        a = self.config.rtt_alpha
        self.rtt_s = seconds if not self.rtt_s else a * seconds + (1 - a) * self.rtt_s
        self.rtt_lost = False
        self._measured_at_ms = self._wall_ms()

    def rtt_timed_out(self) -> None:
        self.rtt_lost = True
        self._measured_at_ms = self._wall_ms()

    # --- the state ----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.failures < self.config.max_failures and not self.rtt_lost

    def state(self) -> LinkState:
        """The link now; stamped with the time of this read (its queue is a snapshot the router
        drains by age), or 0 while nothing was measured yet."""
        queued = sum(p.total for p in self._pushes if not p.started)
        in_flight = sum(p.total - p.read for p in self._pushes if p.started)
        return LinkState(
            self.cluster,
            self.throughput_bps,
            queued,
            in_flight,
            self.rtt_s,
            self._wall_ms() if self._measured_at_ms else 0,
            self.healthy,
        )

    # --- busy-time accounting (MeteredPush) ---------------------------------------------------

    def _busy(self, delta: int) -> None:
        now = self._clock()
        if self._active > 0:
            self._window_busy_s += now - self._busy_from
        self._busy_from = now
        self._active += delta

    def _sent(self, nbytes: int, *, push_done: bool = False) -> None:
        self._window_bytes += nbytes
        busy = self._window_busy_s + (self._clock() - self._busy_from if self._active else 0.0)
        # NOTE: the first measurement need not wait for a whole window: a link whose pushes are
        # all small (or fast) would otherwise never be measured, and the router never leave θ.
        first = push_done and not self.throughput_bps and busy > 0
        if (busy >= self.config.window_s or first) and self._window_bytes:
            sample = self._window_bytes / busy
            a = self.config.alpha
            tp = self.throughput_bps
            self.throughput_bps = sample if not tp else a * sample + (1 - a) * tp
            self._measured_at_ms = self._wall_ms()
            self._window_bytes, self._window_busy_s = 0, 0.0
            self._busy_from = self._clock()

    def _ended(self, push: _Push, ok: bool) -> None:
        self._pushes.discard(push)
        if push.started:
            self._busy(-1)
            if ok:
                self._sent(push.pending, push_done=True)
        self.failures = 0 if ok else self.failures + 1


class MeteredPush:
    """One push's accounting: ``with meter.push(n) as p: await pusher.push(h, p.source(src))``."""

    def __init__(self, meter: LinkMeter, total_bytes: int) -> None:
        if total_bytes < 0:
            raise ValueError(f"total_bytes: must be >= 0, got {total_bytes}")
        self._meter = meter
        self._push = _Push(total_bytes)

    def __enter__(self) -> MeteredPush:
        self._meter._pushes.add(self._push)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # NOTE: only an Exception is the link's failure; a cancelled push (the request went
        # away) says nothing about it.
        ok = exc_type is None or not issubclass(exc_type, Exception)
        self._meter._ended(self._push, ok)

    def source(self, inner: KvSource) -> KvSource:
        return _MeteredSource(self._meter, self._push, inner)


class _MeteredSource:
    """``inner``, reporting to the meter: the first read (a slot is held), bytes read, and the
    time each read waits on the producer (not link-busy time)."""

    def __init__(self, meter: LinkMeter, push: _Push, inner: KvSource) -> None:
        self._meter = meter
        self._push = push
        self._inner = inner

    @property
    def total_bytes(self) -> int:
        return self._inner.total_bytes

    async def ready(self, nbytes: int) -> None:
        await self._inner.ready(nbytes)  # NOTE: no slot held yet: neither busy nor started

    async def read(self, offset: int, length: int) -> memoryview:
        meter, push = self._meter, self._push
        # NOTE: between two reads the push is busy on the link; waiting on the producer (prefill
        # still computing) is not link time. Reads of one push never overlap (one encoder).
        if push.started:
            meter._busy(-1)
            meter._sent(push.pending)
            push.pending = 0
        push.started = True
        try:
            view = await self._inner.read(offset, length)
        finally:
            meter._busy(+1)
        push.read = max(push.read, min(offset + length, push.total))
        push.pending += length
        return view


class LinkMeters:
    """Prefill's meters, one per remote cluster it pushes to."""

    def __init__(self, config: LinkMeterConfig = LinkMeterConfig(), **clocks) -> None:
        self.config = config
        self._clocks = clocks
        self._meters: dict[str, LinkMeter] = {}

    def meter(self, cluster: str) -> LinkMeter:
        m = self._meters.get(cluster)
        if m is None:
            m = self._meters[cluster] = LinkMeter(cluster, self.config, **self._clocks)
        return m

    @property
    def clusters(self) -> list[str]:
        return sorted(self._meters)

    def states(self) -> tuple[LinkState, ...]:
        return tuple(self._meters[c].state() for c in self.clusters)
