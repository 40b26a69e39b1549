"""Agentic trace generator: sessions whose prompts grow turn by turn.

A session is an agent loop. Turn 1's prompt is a prefix of one shared "system
prompt" (tool definitions, instructions) followed by fresh task text. Turn k+1's
prompt is literally turn k's prompt + turn k's output + new user text (a tool
result, a follow-up). So a request's prefix hit comes from real reuse: the MD's
decode-side radix cache holds turn k's prompt *and* output when turn k+1 arrives.

Turn k's output is unknown when the trace is written (the model produces it), so
the trace carries a **placeholder** for it: ``max_tokens`` synthetic "assistant"
tokens, recorded as an ``OutputSlot`` (start, length, request id). The load
generator splices turn k's real output tokens into every later slot before
issuing turn k+1 (``TraceRequest.prompt_with_outputs``), and it asks for
``ignore_eos`` so the output is exactly ``max_tokens`` long and the hit equals
``expected_hit``. Without splicing (another tool, the simulator) the trace is
still self-contained: the placeholder tokens are ordinary prompt text, and only
the previous *prompt* is a repeat.

Per-request target hits (``sample_hit``), as in the report (arXiv 2609.13161):
  skewed  — 75% of requests in U(0.955, 0.995), 25% in U(0.40, 0.95): mean 0.90.
            The low tail is the new sessions first (a new session shares only part
            of the system prompt) then long tool results in later turns.
  uniform — every request in U(0.85, 0.95): mean 0.90, no tail.
A later turn with target h gets ``R·(1-h)/h`` new tokens, R = previous prompt +
output; a first turn with target h starts with ``h·L`` system-prompt tokens.
``expected_hit`` is the exact longest-prefix match against every earlier
request's prompt + output (token level; the serving cache rounds down to blocks).
A turn that would overflow ``max_context_tokens`` compacts: it restarts as a
first turn, as agents do.

Output lengths (``sample_output_tokens``): 30% < 100 tokens, 40% in [100, 500],
30% in (500, 2048], all divided by ``output_scale`` for CPU testbeds.
Arrivals are Poisson at ``rps`` (0: all at t=0), interleaved over at most
``concurrent_sessions`` live sessions. Everything comes from one seeded
``numpy.random.Generator``: the same config gives the same trace.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HIGH_HIT = (0.955, 0.995)
LOW_HIT = (0.40, 0.95)
UNIFORM_HIT = (0.85, 0.95)
SKEWED_LOW_SHARE = 0.25
DISTS = ("skewed", "uniform")
# Unscaled output-length buckets: [lo, hi] inclusive, with their probabilities.
OUTPUT_BUCKETS = ((0.3, 8, 99), (0.4, 100, 500), (0.3, 501, 2048))


@dataclass(frozen=True)
class OutputSlot:
    """Where an earlier turn's output sits inside a later prompt."""

    start: int
    length: int
    request_id: str


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    session_id: str
    timestamp_ms: float
    prompt_token_ids: list[int]
    max_tokens: int
    # Fraction of the prompt that repeats an earlier request's prompt + output.
    expected_hit: float
    turn: int = 0
    output_slots: tuple[OutputSlot, ...] = ()

    def prompt_with_outputs(self, outputs: Mapping[str, Sequence[int]]) -> list[int]:
        """The prompt with every known earlier output spliced into its slot."""
        out: list[int] = []
        pos = 0
        for slot in sorted(self.output_slots, key=lambda s: s.start):
            real = outputs.get(slot.request_id)
            out.extend(self.prompt_token_ids[pos : slot.start])
            end = slot.start + slot.length
            out.extend(self.prompt_token_ids[slot.start : end] if real is None else real)
            pos = end
        out.extend(self.prompt_token_ids[pos:])
        return out

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "turn": self.turn,
            "timestamp_ms": self.timestamp_ms,
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_tokens": self.max_tokens,
            "expected_hit": self.expected_hit,
            "output_slots": [[s.start, s.length, s.request_id] for s in self.output_slots],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> TraceRequest:
        """One trace line's object; a missing or malformed field raises ``ValueError`` naming it."""
        request_id = _field(d, "request_id", str)
        return cls(
            request_id=request_id,
            session_id=_field(d, "session_id", str, request_id),
            timestamp_ms=_field(d, "timestamp_ms", _non_negative(float), 0.0),
            prompt_token_ids=_field(d, "prompt_token_ids", _token_ids),
            max_tokens=_field(d, "max_tokens", _positive_int),
            expected_hit=_field(d, "expected_hit", float, 0.0),
            turn=_field(d, "turn", _non_negative(int), 0),
            output_slots=_field(d, "output_slots", _output_slots, ()),
        )


_REQUIRED = object()


def _field(d: Mapping, name: str, convert, default=_REQUIRED):
    if name not in d:
        if default is _REQUIRED:
            raise ValueError(f"{name}: missing")
        return default
    try:
        return convert(d[name])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from None


def _strict_int(value) -> int:
    # NOTE: int(2.7) and int("3") would pass silently; a token id or a count must be an integer.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _positive_int(value) -> int:
    if _strict_int(value) < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _non_negative(convert):
    def check(value):
        out = convert(_strict_int(value) if convert is int else value)
        if out < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return out

    return check


def _token_ids(value) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list of token ids")
    ids = [_strict_int(t) for t in value]
    if min(ids) < 0:
        raise ValueError(f"token id {min(ids)} is negative")
    return ids


def _output_slots(value) -> tuple[OutputSlot, ...]:
    if not isinstance(value, list):
        raise ValueError("expected a list of [start, length, request_id]")
    slots = []
    for slot in value:
        if not isinstance(slot, list) or len(slot) != 3:
            raise ValueError(f"expected [start, length, request_id], got {slot!r}")
        start, length, rid = slot
        slots.append(OutputSlot(_strict_int(start), _strict_int(length), str(rid)))
    return tuple(slots)


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 16
    turns: int = 6
    rps: float = 1.0
    dist: str = "skewed"
    seed: int = 0
    # Mean first-turn prompt length (each session draws within ±20%).
    prompt_tokens: int = 1024
    max_context_tokens: int = 8192
    output_scale: float = 1.0
    vocab_low: int = 100
    vocab_high: int = 32000
    concurrent_sessions: int = 4
    min_user_tokens: int = 1

    def __post_init__(self) -> None:
        for name in (
            "sessions",
            "turns",
            "prompt_tokens",
            "concurrent_sessions",
            "min_user_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.rps < 0:
            raise ValueError(f"rps: must be >= 0, got {self.rps}")
        if self.dist not in DISTS:
            raise ValueError(f"dist: must be one of {DISTS}, got {self.dist!r}")
        if not 1.0 <= self.output_scale <= 100.0:
            raise ValueError(f"output_scale: must be in [1, 100], got {self.output_scale}")
        if self.max_context_tokens < 2 * self.prompt_tokens:
            raise ValueError(
                f"max_context_tokens: must be >= 2 * prompt_tokens, got {self.max_context_tokens}"
            )
        if not 0 <= self.vocab_low < self.vocab_high or self.vocab_high - self.vocab_low < 16:
            raise ValueError(
                f"vocab_high: need 0 <= vocab_low < vocab_high with >= 16 ids, "
                f"got [{self.vocab_low}, {self.vocab_high})"
            )


def sample_hit(dist: str, rng: np.random.Generator, low_share: float = SKEWED_LOW_SHARE) -> float:
    """One request's target prefix hit; ``low_share`` is the skewed tail's weight."""
    if dist == "uniform":
        return float(rng.uniform(*UNIFORM_HIT))
    if dist != "skewed":
        raise ValueError(f"dist: must be one of {DISTS}, got {dist!r}")
    return float(rng.uniform(*(LOW_HIT if rng.random() < low_share else HIGH_HIT)))


def output_buckets(scale: float = 1.0) -> list[tuple[float, int, int]]:
    """The output-length buckets divided by ``scale``, kept disjoint and non-empty."""
    out: list[tuple[float, int, int]] = []
    lo = max(1, math.ceil(OUTPUT_BUCKETS[0][1] / scale))
    bounds = (math.ceil(100 / scale) - 1, math.floor(500 / scale), math.floor(2048 / scale))
    for (p, _, _), hi in zip(OUTPUT_BUCKETS, bounds):
        hi = max(lo, hi)
        out.append((p, lo, hi))
        lo = hi + 1
    return out


def sample_output_tokens(rng: np.random.Generator, scale: float = 1.0) -> int:
    u = rng.random()
    for p, lo, hi in output_buckets(scale):
        if u < p:
            return int(rng.integers(lo, hi + 1))
        u -= p
    return output_buckets(scale)[-1][2]


def poisson_arrivals_ms(n: int, rps: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times (ms) of a Poisson process at ``rps``, the first at 0; all 0 when rps is 0."""
    if rps <= 0 or n == 0:
        return [0.0] * n
    gaps = rng.exponential(1000.0 / rps, size=n - 1)
    return [0.0] + [round(float(t), 3) for t in np.cumsum(gaps)]


@dataclass
class _Session:
    index: int
    turn: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + output so far
    slots: list[OutputSlot] = field(default_factory=list)
    system_len: int = 0


class _Generator:
    def __init__(self, cfg: TraceConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.system = self._tokens(cfg.max_context_tokens)
        self.max_system_seen = 0  # longest system prefix any earlier request holds
        q = cfg.sessions / (cfg.sessions * cfg.turns)
        # NOTE: the low tail goes to new sessions first, the rest to later turns, so
        # that the whole trace has SKEWED_LOW_SHARE low-hit requests whatever `turns` is.
        self.first_low = min(1.0, SKEWED_LOW_SHARE / q)
        self.later_low = max(0.0, SKEWED_LOW_SHARE - q) / (1 - q) if q < 1 else 0.0

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(self.cfg.vocab_low, self.cfg.vocab_high, size=n).tolist()

    def _hit(self, first: bool) -> float:
        return sample_hit(self.cfg.dist, self.rng, self.first_low if first else self.later_low)

    def _first_turn(self, s: _Session, max_tokens: int) -> tuple[list[int], float]:
        cfg = self.cfg
        length = int(round(cfg.prompt_tokens * self.rng.uniform(0.8, 1.2)))
        length = max(2, min(length, cfg.max_context_tokens - max_tokens))
        shared = min(length - 1, int(round(self._hit(first=True) * length)))
        fresh = self._tokens(length - shared)
        if fresh[0] == self.system[shared]:  # the match must end exactly at `shared`
            fresh[0] = cfg.vocab_low + (fresh[0] - cfg.vocab_low + 1) % (
                cfg.vocab_high - cfg.vocab_low
            )
        hit = min(shared, self.max_system_seen) / length
        self.max_system_seen = max(self.max_system_seen, shared)
        s.system_len, s.slots = shared, []
        return self.system[:shared] + fresh, hit

    def request(self, s: _Session, timestamp_ms: float) -> TraceRequest:
        cfg = self.cfg
        max_tokens = sample_output_tokens(self.rng, cfg.output_scale)
        reused = len(s.tokens)
        if s.turn > 0 and reused + cfg.min_user_tokens + max_tokens <= cfg.max_context_tokens:
            h = self._hit(first=False)
            new = max(cfg.min_user_tokens, int(round(reused * (1 - h) / h)))
            new = min(new, cfg.max_context_tokens - max_tokens - reused)
            prompt, hit = s.tokens + self._tokens(new), reused / (reused + new)
        else:  # a new session, or compaction of one that outgrew its context
            prompt, hit = self._first_turn(s, max_tokens)
        rid = f"s{s.index:04d}-t{s.turn:02d}"
        req = TraceRequest(
            request_id=rid,
            session_id=f"s{s.index:04d}",
            timestamp_ms=timestamp_ms,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            expected_hit=round(hit, 6),
            turn=s.turn,
            output_slots=tuple(s.slots),
        )
        s.slots = s.slots + [OutputSlot(len(prompt), max_tokens, rid)]
        s.tokens = prompt + self._tokens(max_tokens)  # placeholder for this turn's output
        s.turn += 1
        return req


def generate(cfg: TraceConfig) -> list[TraceRequest]:
    """The whole trace, in arrival order."""
    gen = _Generator(cfg)
    times = poisson_arrivals_ms(cfg.sessions * cfg.turns, cfg.rps, gen.rng)
    waiting = [_Session(i) for i in range(cfg.sessions)]
    live = [waiting.pop(0) for _ in range(min(cfg.concurrent_sessions, len(waiting)))]
    out: list[TraceRequest] = []
    for t in times:
        s = live[int(gen.rng.integers(len(live)))]
        out.append(gen.request(s, t))
        if s.turn == cfg.turns:
            live.remove(s)
            if waiting:
                live.append(waiting.pop(0))
    return out


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The trace's requests; a bad line raises ``ValueError`` naming the file, the line and the field."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json_line(line, path, n)
            try:
                out.append(TraceRequest.from_json(row))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
    return out


def json_line(line: str, path: str | Path, n: int) -> dict:
    """Line ``n`` of a JSONL file as an object (``ValueError`` naming ``path:n`` otherwise)."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        msg = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
        raise ValueError(f"{path}:{n}: not a JSON line ({msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
    return row


def describe(requests: Sequence[TraceRequest]) -> str:
    hits = np.array([r.expected_hit for r in requests])
    outs = np.array([r.max_tokens for r in requests])
    plen = np.array([len(r.prompt_token_ids) for r in requests])
    return (
        f"{len(requests)} requests, {len({r.session_id for r in requests})} sessions; "
        f"hit mean {hits.mean():.3f}, >0.95 {np.mean(hits > 0.95):.0%}; "
        f"prompt mean {plen.mean():.0f} max {plen.max()}; output mean {outs.mean():.0f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd trace gen --sessions N --turns T --rps R --dist skewed|uniform --seed S --out FILE``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gen"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="pdd trace gen", description="Generate an agentic trace (JSONL)."
    )
    d = TraceConfig()
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--rps", type=float, default=d.rps, help="Poisson arrival rate; 0 = all at once")
    p.add_argument("--dist", choices=DISTS, default=d.dist)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--prompt-tokens", type=int, default=d.prompt_tokens, help="mean first-turn prompt length"
    )
    p.add_argument("--max-context", type=int, default=d.max_context_tokens)
    p.add_argument(
        "--output-scale",
        type=float,
        default=d.output_scale,
        help="divide the report's output lengths by this (e.g. 10 on CPU)",
    )
    p.add_argument("--vocab-low", type=int, default=d.vocab_low)
    p.add_argument("--vocab-high", type=int, default=d.vocab_high)
    p.add_argument("--concurrent-sessions", type=int, default=d.concurrent_sessions)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        cfg = TraceConfig(
            sessions=a.sessions,
            turns=a.turns,
            rps=a.rps,
            dist=a.dist,
            seed=a.seed,
            prompt_tokens=a.prompt_tokens,
            max_context_tokens=a.max_context,
            output_scale=a.output_scale,
            vocab_low=a.vocab_low,
            vocab_high=a.vocab_high,
            concurrent_sessions=a.concurrent_sessions,
        )
    except ValueError as e:
        p.error(str(e))
    reqs = generate(cfg)
    write_trace(reqs, a.out)
    print(f"{a.out}: {describe(reqs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
