"""Batched engine instances for the simulator: prefill (chunked) and decode (continuous batching).

``DecodeInstance`` (relay, MainDecode, IDC decode): every step decodes one token for each running
sequence and takes up to ``prefill_chunk_tokens`` of queued prefill/extend work (a local prefill,
a handoff's extension) into the same step, whose time is the chip profile's
``decode_ms(batch, context) + extend_chunk_ms(chunk tokens, context before them)`` plus what the
served stage adds to every step (``stream_ms``: its serving loop and its core's neighbours, from
the profile). KV
memory is one budget of ``kv_budget_tokens``: locked cache hits + every admitted sequence's
reservation (prompt + output) + the radix cache, whose LRU entries are evicted to make room; a
sequence that does not fit waits.
Per step the work is O(1 + sequences joining or leaving): a sequence's last step is known when it
joins (a heap), and its token count at time t is the steps ended since it joined (``produced``).

``PrefillInstance``: FIFO chunked prefill; a step takes up to ``prefill_chunk_tokens`` new tokens
of the oldest jobs and lasts ``overhead + Σ prefill_ms(chunk, context)``; its own prefix cache holds
prompts (never outputs), as the engine's radix cache does on prefill. After each step a job's
``chunk`` callback hears how far its prompt is computed (its KV streams out chunk by chunk).
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.bench.sim_cache import SessionCache
from pdd.bench.sim_link import EventLoop
from pdd.bench.sim_profile import ChipProfile

Done = Callable[[float], None]


def _nothing(_: float) -> None:
    return None


@dataclass(eq=False)
class Seq:
    """One request on a decode instance: ``prefill`` tokens first (0: its KV is already there),
    then ``tokens`` decode steps; ``first`` at the end of the first step that yields a token."""

    ctx: int
    tokens: int
    reserve: int
    prefill: int = 0
    locked: int = 0
    # KV this request already holds here (an earlier catch-up round reserved it).
    held: int = 0
    # Keep the reservation when the prefill/extend part ends without decode steps (a catch-up round).
    hold: bool = False
    first: Done = _nothing
    done: Done = _nothing
    start_step: int = -1
    end_step: int = 0
    stopped: bool = False
    left: int = 0  # prefill tokens still to compute

    @property
    def cached(self) -> int:
        """Context before its prefill/extend part: what that part's attention reads."""
        return max(0, self.ctx - self.prefill)


@dataclass(eq=False)
class _Job:
    tokens: int
    cached: int
    done: Done
    # Called after each chunk with the prompt position computed so far (the KV to stream).
    chunk: Callable[[int], None] | None = None
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = self.tokens


class DecodeInstance:
    def __init__(
        self, loop: EventLoop, chip: ChipProfile, name: str, stream_ms: float = 0.0
    ) -> None:
        self.loop, self.chip, self.name = loop, chip, name
        # The served stage's cost per step beyond the engine's (``Profile.*_stream_ms_per_step``).
        self.stream_ms = stream_ms
        self.cache = SessionCache()
        self.locked = 0
        self.reserved = 0
        self.waiting: deque[Seq] = deque()
        self.chunks: deque[Seq] = deque()
        self.running = 0
        self.context = 0.0  # context tokens of the decode batch
        self.ends: list[tuple[int, int, Seq]] = []  # (end_step, seq id, seq)
        self.starting: list[Seq] = []
        self.step = 0  # steps ended
        self.step_ends: list[float] = []
        self.step_tokens: list[int] = []  # decode tokens each step streamed (for the ITL)
        self.busy = False
        self.busy_s = 0.0
        self._ids = itertools.count()

    # --- memory -------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.locked + self.reserved + self.cache.size

    def lock(self, session: int, reuse: int, system: int) -> tuple[int, int]:
        """Lock the prompt's cached prefix until a sequence takes it: (tokens held, tokens locked).

        NOTE: the locked part is the session's own entry; the system prompt stays shared."""
        held = self.cache.held(session, reuse, system)
        own = self.cache.take(session)
        self.locked += own
        return held, own

    def unlock(self, n: int) -> None:
        self.locked -= n

    def put(self, session: int, tokens: int, system: int) -> None:
        self.cache.put(session, tokens, system)
        self._make_room(0)

    def _make_room(self, need: int) -> bool:
        over = self.used + need - self.chip.kv_budget_tokens
        if over > 0:
            self.cache.evict(over)
        return self.used + need <= self.chip.kv_budget_tokens

    # --- work ---------------------------------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._kick()

    def load(self) -> tuple[int, int]:
        return self.running + len(self.chunks), len(self.waiting)

    def _admit(self) -> None:
        while self.waiting and self.running + len(self.chunks) < self.chip.max_batch:
            s = self.waiting[0]
            need = s.reserve - s.held
            self.locked -= s.locked
            if not self._make_room(need) and (self.running or self.chunks or self.reserved):
                self.locked += s.locked
                return
            self.waiting.popleft()
            s.locked = 0
            self.reserved += need
            if s.prefill:
                s.left = s.prefill
                self.chunks.append(s)
            else:
                self._join(s)

    def _join(self, s: Seq) -> None:
        s.start_step = self.step
        self.running += 1
        self.context += s.ctx
        self.starting.append(s)
        s.end_step = self.step + s.tokens
        heapq.heappush(self.ends, (s.end_step, next(self._ids), s))

    def _kick(self) -> None:
        if self.busy:
            return
        self._admit()
        if not self.running and not self.chunks:
            return
        budget, chunk_ms, self._chunked = self.chip.prefill_chunk_tokens, 0.0, []
        for s in self.chunks:
            if budget <= 0:
                break
            n = min(s.left, budget)
            budget -= n
            chunk_ms += self.chip.extend_chunk_ms(n, s.cached + s.prefill - s.left)
            self._chunked.append((s, n))
        ms = self.chip.decode_ms(max(self.running, 1), self.context) + chunk_ms + self.stream_ms
        self.busy = True
        self.busy_s += ms / 1e3
        self.loop.at(self.loop.now + ms / 1e3, self._end)

    def _end(self) -> None:
        now = self.loop.now
        self.step += 1
        self.step_ends.append(now)
        self.step_tokens.append(self.running)
        self.context += self.running
        for s in self.starting:
            if not s.stopped:
                s.first(now)
        self.starting = []
        for s, n in self._chunked:
            s.left -= n
            if not s.left:
                self.chunks.remove(s)
                s.first(now)  # the last chunk's forward pass yields the next token
                s.first = _nothing
                if s.tokens > 0:
                    self._join(s)
                else:
                    if not s.hold:
                        self._free(s)
                    s.done(now)
        while self.ends and self.ends[0][0] <= self.step:
            _, _, s = heapq.heappop(self.ends)
            if s.stopped:
                continue
            self._leave(s)
            s.done(now)
        self.busy = False
        self._kick()

    def _free(self, s: Seq) -> None:
        self.reserved -= s.reserve

    def _leave(self, s: Seq) -> None:
        s.stopped = True
        self.running -= 1
        self.context -= s.ctx + (self.step - s.start_step)
        self._free(s)

    def produced(self, s: Seq, t: float) -> int:
        """Tokens ``s`` had produced here by time ``t``."""
        if s.start_step < 0:
            return 0
        return max(0, min(s.tokens, bisect_right(self.step_ends, t) - s.start_step))

    def stop(self, s: Seq) -> int:
        """Stop ``s`` now (the relay after a handoff); the tokens it produced."""
        if s.stopped:
            return min(s.tokens, self.step - s.start_step) if s.start_step >= 0 else 0
        n = self.produced(s, self.loop.now)
        if s.start_step >= 0:
            self._leave(s)
        else:
            if s in self.waiting:
                self.waiting.remove(s)
            s.stopped = True
        self._kick()
        return n


class PrefillInstance:
    def __init__(self, loop: EventLoop, chip: ChipProfile, name: str) -> None:
        self.loop, self.chip, self.name = loop, chip, name
        self.cache = SessionCache()
        self.jobs: deque[_Job] = deque()
        self.busy = False
        self.busy_s = 0.0
        self.queued_tokens = 0

    def submit(
        self, tokens: int, cached: int, done: Done, chunk: Callable[[int], None] | None = None
    ) -> None:
        self.jobs.append(_Job(max(1, tokens), cached, done, chunk))
        self.queued_tokens += max(1, tokens)
        self._kick()

    def load(self) -> tuple[int, int]:
        return min(len(self.jobs), 1), max(0, len(self.jobs) - 1)

    def put(self, session: int, tokens: int, system: int) -> None:
        self.cache.put(session, tokens, system)
        over = self.cache.size - self.chip.kv_budget_tokens
        if over > 0:
            self.cache.evict(over)

    def _kick(self) -> None:
        if self.busy or not self.jobs:
            return
        budget, ms, self._chunked = self.chip.prefill_chunk_tokens, 0.0, []
        for j in self.jobs:
            if budget <= 0:
                break
            n = min(j.left, budget)
            budget -= n
            ms += self.chip.prefill_ms(n, j.cached + j.tokens - j.left)
            self._chunked.append((j, n))
        ms += self.chip.prefill_overhead_ms
        self.busy = True
        self.busy_s += ms / 1e3
        self.loop.at(self.loop.now + ms / 1e3, self._end)

    def _end(self) -> None:
        now = self.loop.now
        finished = []
        for j, n in self._chunked:
            j.left -= n
            self.queued_tokens -= n
            if j.chunk is not None:
                j.chunk(j.cached + j.tokens - j.left)
            if not j.left:
                finished.append(j)
        for j in finished:
            self.jobs.remove(j)
        self.busy = False
        self._kick()
        for j in finished:
            j.done(now)
