"""The gateway's adaptive bound on requests in flight: as many as the stack serves without queueing.

A fixed bound is wrong on every machine but one: too high, and under a burst the excess is
accepted, queues (in the engines and in the gateway's own event loop), and runs into its deadline
while the stack does work nobody waits for — the goodput collapses; too low, and capacity is
refused. ``GradientLimit`` follows the latency the stack adds when it queues (a TCP-Vegas-like
gradient, as in Netflix's concurrency-limits and Envoy's adaptive concurrency filter):

- every request that gets its first token reports its time to first token (the queueing in
  front of and inside prefill shows there first);
- a short average of those samples against the baseline — the long average of the samples
  taken while the gateway refused nothing, i.e. the latency of the load the stack carries
  without an excess queued at the door — gives the gradient ``tolerance × baseline / short``
  clamped to [0.5, 1]: 1 while the latency is level, below 1 as queueing adds to it;
- the new limit is ``limit × gradient + sqrt(limit)`` (the square root: headroom to probe for
  more), smoothed, within [``min_limit``, ``max_limit``] (``--max-in-flight`` is the ceiling);
- the limit only grows while it is being used (in flight above half of it), so an idle stack
  does not drift to the ceiling and meet the next burst wide open.

# NOTE: the baseline is frozen while the gateway refuses (and for ``short_window`` samples
# after): a burst's own queueing must not become the norm it is measured against — that
# ratchet is what makes a plain long-vs-short gradient creep open under sustained overload.
# It needs no probing phases (Envoy pins the limit low now and then to measure the unloaded
# latency, refusing clients of a stack that is not overloaded): here it is learned whenever
# the stack is not overloaded, which is the only time it can be.

Pure (no clock, no I/O): samples in, the limit out; tested with made-up latencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GradientConfig:
    initial: int = 32
    min_limit: int = 4
    max_limit: int = 1024
    # How much the short-window latency may exceed the long one before the limit falls.
    tolerance: float = 1.2
    # Samples in the short and long exponential averages.
    short_window: int = 16
    long_window: int = 512
    # Weight of each new limit (0..1]; lower is steadier.
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(
                "initial: need 1 <= min_limit <= initial <= max_limit, got "
                f"{self.min_limit} <= {self.initial} <= {self.max_limit}"
            )
        if self.tolerance < 1:
            raise ValueError(f"tolerance: must be >= 1, got {self.tolerance}")
        if not 1 <= self.short_window < self.long_window:
            raise ValueError(
                f"short_window: need 1 <= short_window < long_window, got "
                f"{self.short_window}, {self.long_window}"
            )
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing: must be in (0, 1], got {self.smoothing}")


class _Ewma:
    def __init__(self, window: int) -> None:
        self.alpha = 2.0 / (window + 1)
        self.value = 0.0
        self.count = 0
        self.window = window

    def add(self, x: float) -> float:
        self.count += 1
        if self.count == 1:
            self.value = x
        elif self.count <= self.window:
            self.value += (x - self.value) / self.count  # NOTE: a plain mean until it is filled
        else:
            self.value += self.alpha * (x - self.value)
        return self.value


class GradientLimit:
    def __init__(self, config: GradientConfig = GradientConfig()) -> None:
        self.config = config
        self._limit = float(config.initial)
        self._short = _Ewma(config.short_window)
        self._long = _Ewma(config.long_window)
        # Samples since the gateway last refused a request (the baseline learns only when
        # this is at least short_window).
        self._since_refusal = config.short_window

    def refused(self) -> None:
        """The gateway refused a request at the limit (overload: the baseline stops learning)."""
        self._since_refusal = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    def sample(self, latency_s: float, in_flight: int) -> int:
        """One request's time to first token, with the requests in flight when it came."""
        if latency_s <= 0 or not math.isfinite(latency_s):
            return self.limit
        cfg = self.config
        short = self._short.add(latency_s)
        if self._since_refusal >= cfg.short_window or self._long.count == 0:
            self._long.add(latency_s)
        self._since_refusal += 1
        long = self._long.value
        if self._short.count < cfg.short_window:
            return self.limit  # NOTE: too few samples to tell queueing from noise
        gradient = max(0.5, min(1.0, cfg.tolerance * long / short))
        new = self._limit * gradient + math.sqrt(self._limit)
        new = self._limit * (1 - cfg.smoothing) + new * cfg.smoothing
        if new > self._limit and in_flight < self._limit / 2:
            return self.limit  # NOTE: not using the limit: no evidence it could be higher
        self._limit = max(float(cfg.min_limit), min(float(cfg.max_limit), new))
        return self.limit
