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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdd.telemetry import metrics


class StreamPacer:
    def __init__(self, max_hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s: must be >= 0, got {max_hold_s}")
        self.max_hold_s = max_hold_s
        self.clock = clock
        self.interval_s = 0.0
        self.released = False
        self._last_sent: float | None = None
        self._wake: asyncio.Event | None = None

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
        if self.released or self.interval_s <= 0 or self.max_hold_s <= 0 or self._last_sent is None:
            return 0.0
        due = min(self._last_sent + self.interval_s, computed_at + self.max_hold_s)
        return max(0.0, due - self.clock())

    def sent(self) -> None:
        self._last_sent = self.clock()

    async def hold(self, computed_at: float) -> None:
        """Wait until the token computed at ``computed_at`` may leave (``release`` cuts it short)."""
        wait = self.delay(computed_at)
        if wait > 0:
            start = self.clock()
            if self._wake is None:
                self._wake = asyncio.Event()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass
            metrics.PACE_HOLD.inc(max(0.0, self.clock() - start))
        self.sent()
