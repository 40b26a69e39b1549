"""Joining adjacent runs of output tokens into one event.

A stream that falls behind its producer (an engine stepping faster than one gRPC write per token
per request, a gateway reading faster than its client) holds several token events at once. Sent
one message each, every token pays a whole message's cost at every hop; joined, a backlog costs
one message, and a stream that keeps up is unchanged (``coalesce`` joins only what it is given;
the gateway lets a token wait a turn of its event loop for company: ``Gateway._merged``). Both a
stage's ``Tokens`` and the gateway's ``TokenEvent`` are joined here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, TypeVar

from pdd.core.request import TokenEvent
from pdd.core.stage_events import Tokens

E = TypeVar("E")


def _joinable(prev: object, ev: object) -> bool:
    if not isinstance(ev, (Tokens, TokenEvent)) or type(prev) is not type(ev):
        return False
    assert isinstance(prev, (Tokens, TokenEvent))
    return (
        prev.start_position + len(prev.token_ids) == ev.start_position
        and getattr(prev, "stage", None) == getattr(ev, "stage", None)
        # NOTE: prompt logprobs ride on the event carrying output 0, which can only come first.
        and not ev.prompt_logprobs
        # NOTE: logprobs are one per token or none at all: never a run that mixes both.
        and bool(prev.logprobs) == bool(ev.logprobs)
    )


def coalesce(events: Iterable[E]) -> list[E]:
    """``events`` with each run of contiguous token events (same type, same stage) joined into
    one; every other event stays where it was, in order."""
    out: list[E] = []
    run: list[Any] = []  # the token events (Tokens | TokenEvent) of the run being joined

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:  # NOTE: one new event per run, however long (a saturated gateway's runs are)
            out.append(
                replace(
                    run[0],
                    token_ids=tuple(t for ev in run for t in ev.token_ids),
                    logprobs=tuple(lp for ev in run for lp in ev.logprobs),
                )
            )
        run.clear()

    for ev in events:
        if run and _joinable(run[-1], ev):
            run.append(ev)
            continue
        close()
        if isinstance(ev, (Tokens, TokenEvent)):
            run.append(ev)
        else:
            out.append(ev)
    close()
    return out
