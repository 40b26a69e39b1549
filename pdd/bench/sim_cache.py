"""One instance's radix prefix cache, at the simulator's grain: an LRU of session prefixes.

An agent session's turn k+1 starts with turn k's prompt (+ output, on MainDecode, whose DRC holds
both), so a session's cached blocks are touched together and an LRU over whole sessions stands in
for the engine's block LRU. The shared system prompt is held once per instance (the longest prefix
of it seen) and never evicted: every session reads it. A running request takes its session's entry
out (``take``: locked, not evictable) and puts its prompt (+ output) back when done (``put``), so the
hit rate is an outcome of capacity, sessions and routing rather than a draw.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionCache:
    def __init__(self) -> None:
        self.entries: OrderedDict[int, int] = OrderedDict()  # session → cached tokens, LRU first
        self.system = 0  # longest system-prompt prefix held
        self.size = 0  # tokens held, system prompt included
        self.evicted = 0  # sessions evicted so far

    def held(self, session: int, reuse: int, system: int) -> int:
        """Leading tokens held of a prompt whose first ``reuse`` tokens repeat the session's history
        (0 for a first turn) and whose first ``system`` tokens are the shared system prompt."""
        own = min(self.entries.get(session, 0), reuse)
        return max(own, min(system, self.system))

    def take(self, session: int) -> int:
        n = self.entries.pop(session, 0)
        self.size -= n
        return n

    def put(self, session: int, tokens: int, system: int) -> None:
        self.take(session)
        self.entries[session] = tokens
        self.size += tokens
        if system > self.system:
            self.size += system - self.system
            self.system = system

    def evict(self, need: int) -> int:
        """Evict least recently used sessions until ``need`` tokens are freed (or none are left)."""
        freed = 0
        while freed < need and self.entries:
            _, n = self.entries.popitem(last=False)
            self.size -= n
            freed += n
            self.evicted += 1
        return freed
