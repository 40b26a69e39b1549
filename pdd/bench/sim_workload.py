"""The simulator's requests: agent sessions at the report's scale, or a recorded trace.

Generated (``sessions``): Poisson arrivals at ``rps``; each arrival is the next turn of one of
``live_sessions`` live sessions (picked at random, as ``trace.generate`` does). Turn k+1's prompt is
turn k's prompt + output + new text: with a target hit h (``trace.sample_hit``) it adds
R·(1−h)/h tokens to R = the previous prompt + output, so a turn reuses the session's history, and
whether that history is still cached where the router sends it is up to the caches. A first turn
(or a session that outgrew ``1.3 × context_tokens`` and compacts) is ``0.7 × context_tokens``
(±20 %) long and shares ``h`` of itself with the one system prompt. The low-hit tail goes to first
turns first, then to later turns, so that the whole workload has the distribution's share of low
hits. Sessions grow from 0.7× to 1.3× the context: the mean prompt is about ``context_tokens``;
they start at a random point of that growth, with cold caches (hence the simulator's warm-up).
Outputs: the report's buckets (``trace.sample_output_tokens``) or a fixed ``output_tokens``.

From a trace (``from_trace``): timestamps, prompt lengths, outputs and sessions as recorded; a
later turn's reuse is its ``expected_hit`` × length (the generator's exact prefix match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdd.bench.trace import SKEWED_LOW_SHARE, TraceRequest, sample_hit, sample_output_tokens

FIRST_TURN = 0.7  # × context_tokens
COMPACT_AT = 1.3  # × context_tokens


@dataclass(frozen=True)
class SimRequest:
    rid: int
    arrival: float  # seconds
    session: int
    prompt: int  # tokens
    # Leading tokens that repeat the session's previous prompt + output (0: a first turn).
    reuse: int
    # Leading tokens of the shared system prompt.
    system: int
    output: int
    # The hit the workload meant (reuse or system share over the prompt), before any cache.
    target_hit: float
    # The session's previous turn (-1: none): an agent sends turn k+1 only once turn k is done.
    prev: int = -1


@dataclass
class _Session:
    index: int
    turn: int = 0
    history: int = 0  # prompt + output so far
    system: int = 0
    last: int = -1  # its latest request


def sessions(
    *,
    rps: float,
    duration_s: float,
    dist: str,
    seed: int,
    context_tokens: int,
    live_sessions: int,
    output_tokens: int = 0,
    output_scale: float = 1.0,
) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    n = max(1, int(rps * duration_s))
    times = np.cumsum(rng.exponential(1.0 / rps, size=n))
    mean_turns = np.log(COMPACT_AT / FIRST_TURN) / np.log(1 / 0.9) + 1  # ~6.9 at a 90 % hit
    q = 1 / mean_turns
    first_low = min(1.0, SKEWED_LOW_SHARE / q)
    later_low = max(0.0, SKEWED_LOW_SHARE - q) / (1 - q)
    # NOTE: sessions start mid-life (a random history, none of it cached yet), so that the prompt
    # lengths are steady from the start; the caches warm up during the run's warm-up.
    live = [
        _Session(i, turn=1, history=int(context_tokens * rng.uniform(FIRST_TURN, COMPACT_AT)))
        for i in range(live_sessions)
    ]
    for s in live:
        s.system = int(s.history * rng.uniform(0.1, 0.5))
    next_index = live_sessions
    out = []
    for rid, t in enumerate(times):
        k = int(rng.integers(len(live)))
        s = live[k]
        output = output_tokens or sample_output_tokens(rng, output_scale)
        if s.turn and s.history < COMPACT_AT * context_tokens:
            h = sample_hit(dist, rng, later_low)
            prompt = s.history + max(1, int(round(s.history * (1 - h) / h)))
            reuse, system = s.history, s.system
        else:
            if s.turn:  # compaction: the session starts again, as a new one
                s = live[k] = _Session(next_index, last=s.last)
                next_index += 1
            h = sample_hit(dist, rng, first_low)
            prompt = int(FIRST_TURN * context_tokens * rng.uniform(0.8, 1.2))
            reuse, system = 0, int(h * prompt)
            s.system = system
        out.append(SimRequest(rid, float(t), s.index, prompt, reuse, system, output, h, s.last))
        s.history, s.last = prompt + output, rid
        s.turn += 1
    return out


def from_trace(trace: Sequence[TraceRequest]) -> list[SimRequest]:
    t0 = trace[0].timestamp_ms if trace else 0.0
    sess: dict[str, int] = {}
    system: dict[str, int] = {}
    last: dict[str, int] = {}
    out = []
    for rid, r in enumerate(sorted(trace, key=lambda r: r.timestamp_ms)):
        n = len(r.prompt_token_ids)
        s = sess.setdefault(r.session_id, len(sess))
        shared = int(round(r.expected_hit * n))
        if r.turn == 0 or not r.output_slots:
            reuse = 0
            system[r.session_id] = shared
        else:
            reuse = shared
        out.append(
            SimRequest(
                rid=rid,
                arrival=(r.timestamp_ms - t0) / 1e3,
                session=s,
                prompt=n,
                reuse=reuse,
                system=system.get(r.session_id, 0),
                output=r.max_tokens,
                target_hit=r.expected_hit,
                prev=last.get(r.session_id, -1),
            )
        )
        last[r.session_id] = rid
    return out
