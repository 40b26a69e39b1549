"""The relay's handoff pacing: the hold math on a fake clock, release on a real loop."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from pdd.serving.stream_pacer import LEAD_RAMP, StreamPacer, SwitchTimes


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


def _stream(p: StreamPacer, clock: Clock, computed: list[float]) -> list[float]:
    """When each token leaves if the relay holds each one as the pacer says (fake clock)."""
    left = []
    for c in computed:
        clock.now = max(
            c, left[-1] if left else c
        )  # NOTE: one token at a time, as the relay streams
        clock.now += p.delay(c)
        p.sent(c)
        left.append(clock.now)
    return left


def test_lead_builds_gently_then_holds_steady():
    clock = Clock()
    p = StreamPacer(0.05, clock, lead_s=0.010)
    computed = [100.0 + 0.004 * i for i in range(30)]  # the relay computes a token every 4 ms
    left = _stream(p, clock, computed)
    lags = [out - c for out, c in zip(left, computed)]
    gaps = [b - a for a, b in zip(left, left[1:])]
    assert lags[0] == 0.0  # the first relay token is never held
    # while it builds, the lag grows by LEAD_RAMP of each 4 ms gap: no gap is more than 1.25x longer
    assert lags[1:4] == pytest.approx([0.004 * LEAD_RAMP * k for k in (1, 2, 3)])
    assert max(gaps) == pytest.approx(0.004 * (1 + LEAD_RAMP))
    assert lags[-10:] == pytest.approx([0.010] * 10)  # built: then every token leaves 10 ms late
    assert gaps[-5:] == pytest.approx([0.004] * 5)  # at the relay's own rhythm
    assert p.lag_s == pytest.approx(0.010)


def test_a_slow_token_adds_no_more_lead_than_a_typical_one():
    clock = Clock()
    p = StreamPacer(0.05, clock, lead_s=0.030)
    computed = [100.0 + 0.004 * i for i in range(6)]
    computed.append(computed[-1] + 0.040)  # the relay's core was busy: a 40 ms token
    left = _stream(p, clock, computed)
    assert left[-1] - left[-2] == pytest.approx(0.040 + 0.004 * LEAD_RAMP)  # not 40 ms x 1.25


def test_lead_is_bounded_by_max_hold_and_gone_on_release():
    clock = Clock()
    p = StreamPacer(0.006, clock, lead_s=0.5)
    assert p.lead_s == 0.006
    left = _stream(p, clock, [100.0 + 0.004 * i for i in range(40)])
    assert left[-1] - (100.0 + 0.004 * 39) == pytest.approx(0.006)
    p.release()  # MainDecode took over: what is held leaves at once
    assert p.delay(clock.now) == 0.0


def test_a_paced_lag_beyond_the_lead_is_not_added_to():
    clock = Clock()
    p = StreamPacer(0.05, clock, lead_s=0.002)
    p.pace(0.008)  # MainDecode steps every 8 ms: the relay's 4 ms tokens are paced to that
    computed = [100.0 + 0.004 * i for i in range(6)]
    left = _stream(p, clock, computed)
    assert [b - a for a, b in zip(left, left[1:])] == pytest.approx([0.008] * 5)


def test_negative_lead_is_rejected():
    with pytest.raises(ValueError, match="lead_s"):
        StreamPacer(0.05, lead_s=-0.001)


def test_switch_times_prior_then_longest_recent_per_key():
    times = SwitchTimes(prior_s=0.02, window=3, margin=1.5)
    assert times.lead_s("md-a") == 0.02  # nothing timed yet
    for seconds in (0.004, 0.012, 0.006):
        times.observe("md-a", seconds)
    assert times.lead_s("md-a") == pytest.approx(0.018)  # 1.5 x the longest recent switch
    assert times.lead_s("md-b") == 0.02  # another MainDecode: its own history
    times.observe("md-a", 0.005)
    times.observe("md-a", 0.003)
    assert times.lead_s("md-a") == pytest.approx(0.009)  # the 12 ms switch slid out of the window
    times.observe("md-a", -1.0)  # a clock oddity is not a negative lead
    assert times.lead_s("md-a") == pytest.approx(0.0075)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prior_s=-0.1), "prior_s"),
        (dict(prior_s=0.0, window=0), "window"),
        (dict(prior_s=0.0, margin=0.5), "margin"),
    ],
)
def test_switch_times_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwitchTimes(**kwargs)


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


def test_lead_setting_from_flag_and_config():
    import argparse

    from pdd.server.flags import auto_or_ms
    from pdd.serving.relay import RelayConfig

    assert auto_or_ms("auto") is None and auto_or_ms("12.5") == 12.5 and auto_or_ms("0") == 0.0
    for bad in ("-1", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            auto_or_ms(bad)
    assert RelayConfig().stream_lead_s is None  # learned from recent switches by default
    with pytest.raises(ValueError, match="stream_lead_s"):
        RelayConfig(stream_lead_s=-0.01)
