"""The gateway's adaptive in-flight bound against made-up stacks (no clock, no I/O).

``Stack`` is a modelled stack on a fake clock: it serves ``capacity`` requests at once; a request
admitted with k in flight gets its first token ``base × max(1, k / capacity)`` seconds later (the
queueing a burst causes) and holds its place for ``decode_s`` more, scaled the same way. The
first token reaches the limiter only when it comes — a TTFT after the admission — which is what
a limit moved on every sample got wrong: it kept growing on latencies from before its last raise.
"""

from __future__ import annotations

import heapq
import random
import statistics

import pytest

from pdd.serving.concurrency_limit import GradientConfig, GradientLimit


class Stack:
    def __init__(self, lim: GradientLimit, capacity: int, seed: int, base: float = 0.1) -> None:
        self.lim, self.capacity, self.base = lim, capacity, base
        self.decode_s = 10 * base
        self.rng = random.Random(seed)
        self.now = 0.0
        self.in_flight = 0
        self.events: list[tuple[float, int, str, float, int]] = []
        self.seq = 0
        self.refused = 0
        self.completed: list[float] = []  # when each request ended
        self.ttft: list[tuple[float, float]] = []  # (admitted at, TTFT) of each admitted
        self.limits: list[tuple[float, int]] = []

    def _at(self, t: float, kind: str, value: float = 0.0, round_: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, value, round_))

    def offer(self) -> bool:
        """One request arrives now: admitted (True) or refused at the limit."""
        if self.in_flight >= self.lim.limit:
            self.lim.refused()
            self.refused += 1
            return False
        self.in_flight += 1
        slow = max(1.0, self.in_flight / self.capacity) * self.rng.uniform(0.8, 1.2)
        ttft = self.base * slow
        self.ttft.append((self.now, ttft))
        self._at(self.now + ttft, "first", ttft, self.lim.round)
        self._at(self.now + ttft + self.decode_s * slow, "end")
        return True

    def run_until(self, t_end: float, arrivals: float = 0.0, clients: int = 0) -> None:
        """Poisson arrivals at ``arrivals``/s (open loop), or ``clients`` back to back."""
        if arrivals:
            self._at(self.now + self.rng.expovariate(arrivals), "arrive")
        for _ in range(clients):
            if not self.offer():
                self._at(self.now + self.base, "client")
        while self.events and self.events[0][0] <= t_end:
            self.now, _, kind, value, round_ = heapq.heappop(self.events)
            if kind == "first":
                self.lim.sample(value, self.in_flight, round_)
                self.limits.append((self.now, self.lim.limit))
            elif kind == "end":
                self.in_flight -= 1
                self.completed.append(self.now)
                if clients:
                    self._at(self.now, "client")
            elif kind == "client" and not self.offer():
                self._at(self.now + self.base, "client")
            elif kind == "arrive":
                self.offer()
                self._at(self.now + self.rng.expovariate(arrivals), "arrive")
        self.events = [e for e in self.events if e[2] in ("first", "end")]
        heapq.heapify(self.events)
        self.now = t_end

    def rate(self, t0: float, t1: float) -> float:
        return sum(t0 <= t < t1 for t in self.completed) / (t1 - t0)

    def ttfts(self, t0: float, t1: float) -> list[float]:
        return [x for at, x in self.ttft if t0 <= at < t1]


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


@pytest.mark.parametrize("capacity", [8, 32, 128])
def test_a_burst_of_5x_keeps_goodput_and_the_ttft_shape_of_capacity(capacity):
    """Capacity as the burst bench measures it (as many clients back to back as the stack
    serves at once), then 5× that rate as open arrivals: completions stay at capacity, the
    admitted keep capacity's TTFT within 2×, and the limit holds steady instead of swinging."""
    stack = Stack(GradientLimit(GradientConfig(initial=16)), capacity, seed=capacity)
    stack.run_until(60.0, clients=capacity)
    capacity_rps = stack.rate(30.0, 60.0)
    at_capacity = stack.ttfts(30.0, 60.0)
    stack.events = [e for e in stack.events if e[2] != "client"]  # the clients stop
    stack.run_until(180.0, arrivals=5 * capacity_rps)
    assert stack.refused > 0
    assert stack.rate(70.0, 180.0) >= 0.9 * capacity_rps
    burst = stack.ttfts(70.0, 180.0)
    assert statistics.median(burst) <= 2 * statistics.median(at_capacity)
    assert p90(burst) <= 2 * p90(at_capacity), (p90(burst), p90(at_capacity))
    settled = [lim for t, lim in stack.limits if t >= 70.0]
    assert 0.7 * capacity <= min(settled) and max(settled) <= 2.5 * capacity, (
        min(settled),
        max(settled),
    )


def test_the_burst_is_met_at_the_limit_capacity_used_not_wide_open():
    """A steady load never drives the limit above what it uses plus the probe, so the first
    wave of a burst is not let in at a multiple of the stack's concurrency."""
    stack = Stack(GradientLimit(GradientConfig(initial=4)), 16, seed=3)
    stack.run_until(60.0, clients=16)
    assert 16 <= stack.lim.limit <= 16 + 5


def test_it_grows_while_used_and_the_latency_is_level():
    stack = Stack(GradientLimit(GradientConfig(initial=8, max_limit=256)), 100_000, seed=0)
    stack.run_until(60.0, arrivals=2000.0)  # never queues: every limit is used, latency level
    assert stack.lim.limit == 256


def test_an_idle_stack_does_not_drift_open():
    lim = GradientLimit(GradientConfig(initial=32, max_limit=1024))
    for _ in range(2000):
        lim.sample(0.2, 3, lim.round)  # level latency, the limit barely used
    assert lim.limit == 32


def test_it_falls_when_the_stack_slows_and_recovers_when_it_comes_back():
    stack = Stack(GradientLimit(GradientConfig(initial=64, max_limit=1024)), 512, seed=1)
    stack.run_until(60.0, arrivals=3000.0)  # a fast stack under a flood: the limit opens up
    opened = stack.lim.limit
    assert opened > 300
    stack.capacity = 16  # the stack slows to 16 at once (say, a MainDecode lost)
    # NOTE: a limit is judged by requests admitted under it: none are until the requests let in
    # before the slowdown (each now 30× slower) have drained below it
    stack.run_until(240.0, arrivals=3000.0)
    assert stack.lim.limit <= 40
    assert stack.rate(200.0, 240.0) >= 0.9 * 16 / 1.1  # what the slow stack serves
    stack.capacity = 512  # and comes back
    stack.run_until(300.0, arrivals=3000.0)
    assert stack.lim.limit > 300


def test_samples_of_earlier_rounds_do_not_move_the_limit():
    lim = GradientLimit(GradientConfig(initial=32))
    for _ in range(32):
        lim.sample(0.1, 32, lim.round)  # a level baseline; rounds pass
    before, old_round = lim.limit, lim.round - 1
    lim.refused()
    for _ in range(100):  # a queue let in under an earlier limit reports late
        lim.sample(5.0, 32, old_round)
    assert lim.limit == before


def test_bad_samples_are_ignored_and_bounds_hold():
    lim = GradientLimit(GradientConfig(initial=8, min_limit=4, max_limit=16))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert lim.sample(bad, 8, lim.round) == 8
    for _ in range(500):
        lim.sample(100.0, 16, lim.round)
    assert 4 <= lim.limit <= 16


def test_a_long_burst_does_not_ratchet_the_limit_open():
    """Sustained overload for many long windows: the limit stays put (the burst's queueing
    never becomes the baseline)."""
    stack = Stack(GradientLimit(GradientConfig(initial=16, long_window=256)), 32, seed=2)
    stack.run_until(30.0, clients=16)
    stack.events = [e for e in stack.events if e[2] != "client"]
    stack.run_until(600.0, arrivals=5 * 32 / 1.1)
    assert max(lim for t, lim in stack.limits if t > 300) <= 2.5 * 32


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"initial": 2, "min_limit": 4}, "initial"),
        ({"initial": 2000}, "initial"),
        ({"tolerance": 0.5}, "tolerance"),
        ({"short_window": 600}, "short_window"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"headroom": 0.0}, "headroom"),
    ],
)
def test_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=field):
        GradientConfig(**kw)


def test_a_steady_load_below_the_limit_does_not_walk_it_down():
    """Requests well under the limit whose latency swings by itself (long and short prompts, a
    restart): rounds above the baseline are not queueing the limit caused, so it stays."""
    lim = GradientLimit(GradientConfig(initial=32))
    rng = random.Random(4)
    for _ in range(5000):
        lim.sample(rng.lognormvariate(-2.0, 0.8), rng.randrange(2, 12), lim.round)
    assert lim.limit == 32
    for _ in range(200):  # the same swings with the limit in use: it does fall
        lim.sample(rng.lognormvariate(-1.0, 0.8), 32, lim.round)
    assert lim.limit < 32
