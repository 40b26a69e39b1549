"""``coalesce``: adjacent token runs joined, everything else kept in place."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdd.core.pipeline import Stage
from pdd.core.request import TokenEvent
from pdd.core.sampling_params import Logprob
from pdd.core.stage_events import Finished, Tokens
from pdd.core.token_runs import coalesce


def lp(x: float) -> Logprob:
    return Logprob(x, ())


def test_contiguous_tokens_join_with_their_logprobs():
    events = [Tokens(3, (7,), (lp(-1),)), Tokens(4, (8, 9), (lp(-2), lp(-3)))]
    assert coalesce(events) == [Tokens(3, (7, 8, 9), (lp(-1), lp(-2), lp(-3)))]


def test_what_cannot_join_stays_apart_in_order():
    fin = Finished("length", 9, 9)
    events = [
        Tokens(0, (1,)),
        Tokens(2, (3,)),  # a gap: position 1 is missing
        TokenEvent(3, (4,), Stage.RELAY),  # another type
        TokenEvent(4, (5,), Stage.MAIN_DECODE),  # another stage
        TokenEvent(5, (6,), Stage.MAIN_DECODE, prompt_logprobs=(lp(0),)),  # prompt's: first only
        TokenEvent(6, (7,), Stage.MAIN_DECODE, (lp(-1),)),  # logprobs where the run has none
        fin,
        Tokens(7, (8,)),  # after a non-token event
    ]
    assert coalesce(events) == events


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.booleans()), max_size=30))
def test_joining_keeps_every_token_at_its_position(runs):
    """Against the slow reference: position → (token, stage) is the same before and after, and
    no two neighbours that could join are left apart."""
    events, pos = [], 0
    for gap, n, relay in runs:
        pos += gap
        stage = Stage.RELAY if relay else Stage.MAIN_DECODE
        events.append(TokenEvent(pos, tuple(range(pos, pos + n)), stage))
        pos += n

    def by_position(evs):
        return [(e.start_position + i, t, e.stage) for e in evs for i, t in enumerate(e.token_ids)]

    out = coalesce(events)
    assert by_position(out) == by_position(events)
    for a, b in zip(out, out[1:]):
        assert a.start_position + len(a.token_ids) != b.start_position or a.stage != b.stage
