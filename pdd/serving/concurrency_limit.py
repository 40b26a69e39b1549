"""The gateway's adaptive bound on requests in flight: as many as the stack serves without queueing.

A fixed bound is wrong on every machine but one: too high, and under a burst the excess is
accepted, queues (in the engines and in the gateway's own event loop), and runs into its deadline
while the stack does work nobody waits for — the goodput collapses; too low, and capacity is
refused. ``GradientLimit`` follows the latency the stack adds when it queues (a TCP-Vegas-like
gradient, as in Netflix's concurrency-limits and Envoy's adaptive concurrency filter):

- every request that gets its first token reports its time to first token (the queueing in
  front of and inside prefill shows there first), with the *round* it was admitted in;
- a round is the time one limit is in force: it ends once ``window`` requests admitted under it
  have reported (at least 4, at most ``short_window``, at most the limit). Their mean against
  the baseline — the long average of the samples taken while the gateway refused nothing, i.e.
  the latency of the load the stack carries without an excess queued at the door — gives the
  gradient ``tolerance × baseline / mean`` clamped to [0.5, 1]: 1 while the latency is level,
  below 1 as queueing adds to it;
- the next limit is ``limit × gradient + headroom × sqrt(limit)`` (the probe for more),
  smoothed, within [``min_limit``, ``max_limit``] (``--max-in-flight`` is the ceiling); so the
  admitted settle where their mean TTFT is about tolerance / (1 − headroom / sqrt(limit)) × the
  baseline — 1.1 / (1 − 0.75 / sqrt(limit)), 1.35× at a limit of 16, 1.27× at 30;
- a round that did not come near the limit (its most requests in flight plus the probe below
  it) did not test it: the limit may grow only to that peak plus the probe, so an idle or
  steady stack does not drift open and meet the next burst wide open (TCP's congestion-window
  validation, RFC 7661), and does not fall — a steady load's slow turns (long prompts, a
  restart) are not queueing the limit caused.

# NOTE: one update per round, judged only by requests admitted under the limit being judged.
# The samples of a burst arrive a TTFT after their admission; a limit moved on every sample
# (the first version) kept growing on latencies from before its last raise, then fell to the
# floor on the queue those raises had let in — measured (`pdd bench burst --own-stack`, its
# `gateway_bound`) swinging 5 ↔ 158 every few seconds, the accepted TTFT's P90 3-4× capacity's.
# NOTE: the baseline is frozen while the gateway refuses (and for ``short_window`` samples
# after; its first ``short_window`` are always taken): a burst's own queueing must not become
# the norm it is measured against — that ratchet is what makes a plain long-vs-short gradient
# creep open under sustained overload.
# It needs no probing phases (Envoy pins the limit low now and then to measure the unloaded
# latency, refusing clients of a stack that is not overloaded): here it is learned whenever
# the stack is not overloaded, which is the only time it can be.

Pure (no clock, no I/O): samples in, the limit out; tested with made-up latencies and with a
modelled stack whose latency answers a TTFT after the admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GradientConfig:
    initial: int = 32
    min_limit: int = 4
    max_limit: int = 1024
    # How much a round's mean latency may exceed the baseline before the limit falls.
    tolerance: float = 1.1
    # Samples a round waits for (at most; fewer at a small limit), and in the baseline's average.
    short_window: int = 16
    long_window: int = 512
    # Weight of each new limit (0..1]; lower is steadier.
    smoothing: float = 0.5
    # The probe: headroom × sqrt(limit) more requests each round (the queue the limit allows).
    headroom: float = 0.75

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
        if not self.headroom > 0:
            raise ValueError(f"headroom: must be > 0, got {self.headroom}")


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
        self._long = _Ewma(config.long_window)
        # Samples since the gateway last refused a request (the baseline learns only when
        # this is at least short_window).
        self._since_refusal = config.short_window
        # The current round: its number, and its own requests' samples so far.
        self.round = 0
        self._sum = 0.0
        self._count = 0
        self._peak = 0

    def refused(self) -> None:
        """The gateway refused a request at the limit (overload: the baseline stops learning)."""
        self._since_refusal = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    def _window(self) -> int:
        return max(min(4, self.config.short_window), min(self.config.short_window, self.limit))

    def sample(self, latency_s: float, in_flight: int, admitted_round: int) -> int:
        """One request's time to first token, the requests in flight when it came, and the
        ``round`` it was admitted in (read at its admission)."""
        if latency_s <= 0 or not math.isfinite(latency_s):
            return self.limit
        cfg = self.config
        # NOTE: the first short_window samples always: a baseline of one draw skews every round
        if self._since_refusal >= cfg.short_window or self._long.count < cfg.short_window:
            self._long.add(latency_s)
        self._since_refusal += 1
        self._peak = max(self._peak, in_flight)
        if admitted_round != self.round:
            return self.limit  # NOTE: admitted under an earlier limit: says nothing of this one
        self._sum += latency_s
        self._count += 1
        if self._count < self._window():
            return self.limit
        gradient = max(0.5, min(1.0, cfg.tolerance * self._long.value * self._count / self._sum))
        probe = cfg.headroom * math.sqrt(self._limit)
        new = self._limit * gradient + probe
        new = self._limit * (1 - cfg.smoothing) + new * cfg.smoothing
        if self._peak + probe < self._limit:
            # NOTE: the round did not come near the limit, so it says nothing of it: no evidence it
            # could be higher, nor that it must be lower (a steady load's slow turns walked it down
            # onto the load's own peaks, which it then refused)
            new = self._limit
        elif new > self._limit:
            new = min(new, self._peak + probe)  # NOTE: at most one probe beyond what was used
        self._limit = max(float(cfg.min_limit), min(float(cfg.max_limit), new))
        self.round += 1
        self._sum, self._count, self._peak = 0.0, 0, 0
        return self.limit
