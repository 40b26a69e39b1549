"""The relay's handoff pacing: the hold math on a fake clock, release on a real loop."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from pdd.serving.stream_pacer import StreamPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_hold_until_paced():
    clock = Clock()
    p = StreamPacer(0.05, clock)
    p.sent()
    assert p.delay(clock.now) == 0.0
    p.pace(0.0)  # MainDecode's interval unknown: nothing to pace to
    assert p.delay(clock.now) == 0.0


def test_one_token_per_interval():
    clock = Clock()
    p = StreamPacer(0.05, clock)
    p.pace(0.010)
    p.sent()  # the first token after the pace starts is never held: nothing was sent before it
    clock.now += 0.004
    assert p.delay(clock.now) == pytest.approx(0.006)
    clock.now += 0.006
    p.sent()
    clock.now += 0.015  # slower than the pace: leaves at once
    assert p.delay(clock.now) == 0.0


def test_hold_is_bounded_from_when_the_token_was_computed():
    clock = Clock()
    p = StreamPacer(0.02, clock)
    p.pace(0.5)  # a stalled MainDecode must not slow the relay's stream to its crawl
    p.sent()
    computed_at = clock.now - 0.015  # waited in the queue while earlier tokens were held
    assert p.delay(computed_at) == pytest.approx(0.005)
    assert p.delay(clock.now - 0.03) == 0.0


def test_first_token_is_not_held_and_release_ends_pacing_for_good():
    clock = Clock()
    p = StreamPacer(0.05, clock)
    p.pace(0.01)
    assert p.delay(clock.now) == 0.0  # nothing sent yet
    p.sent()
    assert p.delay(clock.now) > 0
    p.release()
    assert p.delay(clock.now) == 0.0
    p.pace(0.01)  # a late ack after the switch changes nothing
    assert p.delay(clock.now) == 0.0


def test_max_hold_zero_turns_pacing_off():
    clock = Clock()
    p = StreamPacer(0.0, clock)
    p.pace(0.01)
    p.sent()
    assert p.delay(clock.now) == 0.0


def test_negative_hold_is_rejected():
    with pytest.raises(ValueError, match="max_hold_s"):
        StreamPacer(-1.0)


async def test_release_cuts_a_hold_short():
    p = StreamPacer(60.0)
    p.pace(30.0)
    p.sent()
    holding = asyncio.create_task(p.hold(p.clock()))
    await asyncio.sleep(0.01)
    assert not holding.done()  # held: the pace says 30 s
    p.release()
    await asyncio.wait_for(holding, 5.0)


def _held_total() -> float:
    return REGISTRY.get_sample_value("pdd_relay_pace_hold_seconds_total") or 0.0


async def test_hold_waits_at_least_the_pace_and_counts_it():
    before = _held_total()
    p = StreamPacer(1.0)
    p.pace(0.03)
    p.sent()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await p.hold(p.clock())
    # NOTE: a lower bound only (a sleep never ends early); nothing here bounds it from above.
    assert loop.time() - t0 >= 0.025
    assert _held_total() - before >= 0.025
