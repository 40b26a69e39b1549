"""Stop sequences on streamed text: release text until a stop string appears.

A stop string may arrive split over several deltas, so the tail that could
still become one is held back; what is released never contains a stop
string, and the stop string itself is never released (OpenAI's semantics).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Text safe to release after ``text``; sets ``hit`` once a stop string appeared."""
        if self.hit:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        at = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.hit, self._held = True, ""
            return buf[:at]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, once the stream ended without a stop string."""
        out, self._held = self._held, ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest
