"""The relay's stream pacing during a handoff: the user should not see the switch.

When the relay (a few streams) decodes faster than a loaded MainDecode, it runs
ahead during the handoff: the user gets its last tokens quickly, then one long gap
while MainDecode — a WAN hop away — extends them, computes the next token and
streams it back. That gap is the relay's lead, and stopping the relay earlier or
later cannot remove it (MainDecode is slower, so the lead only grows).

Pacing spreads the lead over the handoff's tokens instead. From the moment
MainDecode holds the KV, each relay token leaves no sooner than one MainDecode
step after the previous one (the rhythm the stream has after the switch anyway),
and never more than ``max_hold_s`` after the relay computed it; once MainDecode
has taken over (or the request finished here), whatever is held leaves at once.

What it costs: a few relay tokens reach the user up to ``max_hold_s`` later than
they could have. What it does not cost: MainDecode's timeline depends only on
when the relay *sends* its rounds, not on when the user sees the relay's tokens,
so the request's end-to-end latency and TPOT are unchanged. When MainDecode is
the faster one (the report's hardware) the pace never binds.

The lead. Even level with MainDecode, the switch itself costs time: the final
batch's hop to MainDecode, its step in flight, the extension step and the hop
back (the *switch time*, ~2-4 ITLs on the testbed). A relay whose stream is
level with its computation shows that as one stall. So, like a media player's
jitter buffer, the relay builds a small playout lead from its first token:
each token leaves at most ``LEAD_RAMP`` of its natural gap (of a typical gap,
if longer) later than the one before, until tokens leave ``lead_s`` after they
were computed. At the switch the held tokens fill the switch time. The lead is
1.5 × the longest recent switch to the same MainDecode (``SwitchTimes``), never
more than ``max_hold_s``; it costs the relay's tokens that much latency and
nothing else (the held tokens leave at once when MainDecode has taken over or
the request finished). Unlike a media player's buffer it does not drain to hide
a stall of the relay's own: a token never leaves before it was computed + lag.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Hashable

from pdd.telemetry import metrics

# NOTE: while the lead builds, the stream runs at most this much slower than the relay computes
# (+25 %: a 4 ms ITL becomes 5 ms), so building a 20-30 ms lead takes ~20-30 tokens. A slow token
# (the relay's core was busy) adds no more than a typical one: its gap is long enough already.
LEAD_RAMP = 0.25


class StreamPacer:
    def __init__(
        self, max_hold_s: float, clock: Callable[[], float] = time.monotonic, *, lead_s: float = 0.0
    ) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s: must be >= 0, got {max_hold_s}")
        if lead_s < 0:
            raise ValueError(f"lead_s: must be >= 0, got {lead_s}")
        self.max_hold_s = max_hold_s
        self.lead_s = min(lead_s, max_hold_s)
        self.clock = clock
        self.interval_s = 0.0
        self.released = False
        self._last_sent: float | None = None
        self._last_computed: float | None = None
        self._lag_s = 0.0  # how long after it was computed the last token left
        self._typical_gap_s: float | None = None  # EWMA of the gaps between computed tokens
        self._wake: asyncio.Event | None = None

    @property
    def lag_s(self) -> float:
        """How long after it was computed the last token left (the lead held right now)."""
        return self._lag_s

    def pace(self, interval_s: float) -> None:
        """From now on, at most one token per ``interval_s`` (MainDecode's step time; 0: unknown)."""
        if not self.released:
            self.interval_s = max(0.0, interval_s)

    def release(self) -> None:
        """The switch is over (or will never come): no more holding, held tokens leave at once."""
        self.released = True
        if self._wake is not None:
            self._wake.set()

    def delay(self, computed_at: float) -> float:
        """Seconds to hold a token the relay computed at ``computed_at`` (``clock`` time)."""
        if self.released or self.max_hold_s <= 0 or self._last_sent is None:
            return 0.0
        due = computed_at + self._lag_target(computed_at)
        if self.interval_s > 0:
            due = max(due, self._last_sent + self.interval_s)
        due = min(due, computed_at + self.max_hold_s)
        return max(0.0, due - self.clock())

    def _lag_target(self, computed_at: float) -> float:
        if self.lead_s <= 0 or self._last_computed is None:
            return 0.0
        gap = max(0.0, computed_at - self._last_computed)
        typical = gap if self._typical_gap_s is None else self._typical_gap_s
        return min(self.lead_s, self._lag_s + LEAD_RAMP * min(gap, typical))

    def sent(self, computed_at: float | None = None) -> None:
        now = self.clock()
        self._last_sent = now
        if computed_at is not None:
            if self._last_computed is not None:
                gap = max(0.0, computed_at - self._last_computed)
                self._typical_gap_s = (
                    gap if self._typical_gap_s is None else 0.8 * self._typical_gap_s + 0.2 * gap
                )
            self._last_computed = computed_at
            self._lag_s = max(0.0, now - computed_at)

    async def hold(self, computed_at: float) -> None:
        """Wait until the token computed at ``computed_at`` may leave (``release`` cuts it short)."""
        wait = self.delay(computed_at)
        if wait > 0:
            start = self.clock()
            if self._wake is None:
                self._wake = asyncio.Event()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass
            metrics.PACE_HOLD.inc(max(0.0, self.clock() - start))
        self.sent(computed_at)


class SwitchTimes:
    """How long recent switches to each MainDecode took: the lead of the relay's next request there.

    A switch is timed from sending the final batch to MainDecode's acknowledgement, which
    MainDecode sends as it emits its first token. The lead is ``margin`` × the longest of the last
    ``window`` (a stall the size of a typical switch is still a stall, and the next one may be
    longer: on the testbed they took 4-32 ms, the step in flight at MainDecode being what varies),
    ``prior_s`` until one was timed.
    """

    def __init__(self, prior_s: float, window: int = 16, margin: float = 1.5) -> None:
        if prior_s < 0:
            raise ValueError(f"prior_s: must be >= 0, got {prior_s}")
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        if margin < 1:
            raise ValueError(f"margin: must be >= 1, got {margin}")
        self.prior_s = prior_s
        self.margin = margin
        self._recent: dict[Hashable, collections.deque[float]] = {}
        self._window = window

    def lead_s(self, key: Hashable) -> float:
        recent = self._recent.get(key)
        return self.margin * max(recent) if recent else self.prior_s

    def observe(self, key: Hashable, seconds: float) -> None:
        self._recent.setdefault(key, collections.deque(maxlen=self._window)).append(
            max(0.0, seconds)
        )
