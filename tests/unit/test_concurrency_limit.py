"""The gateway's adaptive in-flight bound against a made-up stack (no clock, no I/O).

The model stack serves ``capacity`` requests at once at ``base`` seconds to first token; every
request beyond waits its turn, so the latency grows as in_flight / capacity — the queueing a
burst causes. Demand is unbounded (a burst), so in flight = the limit.
"""

from __future__ import annotations

import random

import pytest

from pdd.serving.concurrency_limit import GradientConfig, GradientLimit


def _latency(in_flight: int, capacity: int, base: float, rng: random.Random) -> float:
    queued = max(1.0, in_flight / capacity)
    return base * queued * rng.uniform(0.9, 1.1)


def _drive(
    lim: GradientLimit, capacity: int, n: int, rng: random.Random, *, burst: bool = True
) -> list[int]:
    """``n`` samples at in flight = the limit; ``burst``: more demand than that, so the gateway
    refuses a request between every two samples."""
    seen = []
    for _ in range(n):
        if burst:
            lim.refused()
        seen.append(lim.sample(_latency(lim.limit, capacity, 0.2, rng), lim.limit))
    return seen


@pytest.mark.parametrize("capacity", [8, 32, 128])
def test_under_a_burst_the_limit_settles_near_what_the_stack_serves(capacity):
    rng = random.Random(capacity)
    lim = GradientLimit(GradientConfig(initial=16, max_limit=1024))
    # Warm: the stack's latency without queueing (a few requests, well under capacity).
    for _ in range(64):
        lim.sample(_latency(min(lim.limit, capacity // 2), capacity, 0.2, rng), capacity // 2)
    seen = _drive(lim, capacity, 3000, rng)
    tail = seen[-1000:]
    # Neither collapsed to the floor nor wide open: within a small factor of the capacity, so
    # the excess of a burst is refused instead of queueing into its deadline.
    assert capacity * 0.7 <= min(tail) and max(tail) <= capacity * 2.5, (min(tail), max(tail))
    # And steady: the latency of the admitted stays within ~2.5x the unqueued latency.
    assert max(tail) / capacity <= 2.5


def test_it_grows_while_used_and_the_latency_is_level():
    lim = GradientLimit(GradientConfig(initial=8, max_limit=256))
    rng = random.Random(0)
    _drive(lim, 10_000, 400, rng, burst=False)  # far larger than the limit: no queueing ever
    assert lim.limit == 256


def test_an_idle_stack_does_not_drift_open():
    lim = GradientLimit(GradientConfig(initial=32, max_limit=1024))
    for _ in range(2000):
        lim.sample(0.2, in_flight=3)  # level latency, the limit barely used
    assert lim.limit == 32


def test_it_falls_when_queueing_appears_and_recovers_when_it_drains():
    rng = random.Random(1)
    lim = GradientLimit(GradientConfig(initial=64, max_limit=1024))
    _drive(lim, 10_000, 200, rng)  # fast stack: the limit opens up
    opened = lim.limit
    assert opened > 200
    _drive(lim, 16, 1500, rng)  # the stack slows to 16 at once (say, a MainDecode lost)
    assert lim.limit <= 40
    _drive(lim, 10_000, 1500, rng)  # and comes back
    assert lim.limit > 200


def test_bad_samples_are_ignored_and_bounds_hold():
    lim = GradientLimit(GradientConfig(initial=8, min_limit=4, max_limit=16))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert lim.sample(bad, 8) == 8
    for _ in range(500):
        lim.sample(100.0 if lim.limit > 4 else 100.0, 16)
    assert 4 <= lim.limit <= 16


def test_a_long_burst_does_not_ratchet_the_limit_open():
    """Sustained overload for many long windows: the limit stays put (the burst's queueing
    never becomes the baseline)."""
    rng = random.Random(2)
    lim = GradientLimit(GradientConfig(initial=16, long_window=256))
    for _ in range(64):
        lim.sample(_latency(8, 32, 0.2, rng), 8)
    seen = _drive(lim, 32, 20 * 256, rng)
    assert max(seen[-2000:]) <= 2.5 * 32


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"initial": 2, "min_limit": 4}, "initial"),
        ({"initial": 2000}, "initial"),
        ({"tolerance": 0.5}, "tolerance"),
        ({"short_window": 600}, "short_window"),
        ({"smoothing": 0.0}, "smoothing"),
    ],
)
def test_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=field):
        GradientConfig(**kw)
