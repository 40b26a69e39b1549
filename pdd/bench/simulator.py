"""Discrete-event simulator of IDC-PD, CDC-PD and PDD at the report's scale.

Workload: Poisson arrivals at ``rps``; each request has a ``context_tokens``
prompt (±10%), a prefix hit drawn from the trace generator's skewed or uniform
distribution (``trace.sample_hit``), and a report-shaped output length. Prefill
and MainDecode both hold the hit part, so prefill computes and the WAN carries
only the miss ("delta": the decode-side radix cache, docs/architecture.md).

Life of a request:
  prefill   FIFO over ``prefill_instances``: overhead + miss / prefill rate.
  IDC-PD    delta over the same-DC fast link, then one flagship decode step.
            Equal cost buys fewer prefill chips (``idc_prefill_instances``).
  CDC-PD    delta over one of ``wan_links`` WAN links (``SimLink``: a pool of
            ``pool_streams`` streams sharing ``wan_gbps``, FIFO beyond), then one
            MD step and the WAN's one-way delay back.
  PDD       miss ≤ ``local_prefill_tokens`` (0 = off, the design's router) → MD
            (conditional disaggregation, as the live router's flag of that name):
            no prefill stage and nothing on the WAN. The request crosses the WAN
            to MainDecode (one delay), waits in a FIFO over ``md_instances``,
            which prefill the miss themselves at ``md_prefill_tokens_per_s``
            (+ overhead), then one MD step and the delay back. Else hit ≥ θ →
            P-MD as CDC-PD, its transfer urgent in the pool. Else
            P-RLD-MD if a relay slot is free: full KV over the fast link, the relay
            emits the first token and decodes until the (background) delta lands
            on MD, then hands off: one-shot when the relay pool is busy (MD
            extends the relay's k tokens, the user waits one extend: the handoff
            gap), else catch-up (the relay keeps decoding while MD extends, until
            MD is level; the gap is about one step). A full relay pool sends the
            request down P-MD.
Decode capacity is not modelled (one step time per token); decode chips enter
only the cost. So neither is the slowdown a local prefill causes MainDecode's
decode batch (every stream batched with it waits longer for its next token):
the MD pipeline here is optimistic about that cost, and its FIFO gives one
request a MainDecode instance's whole prefill rate at a time. Goodput is the
largest RPS meeting the SLA (P90 TTFT < 10 s, P99 < 15 s), by bisection; the
benefit-cost ratio is PDD's goodput per unit cost over a baseline's, minus one
(``economics.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pdd.bench.sim_link import EventLoop, SimLink
from pdd.bench.trace import DISTS, sample_hit, sample_output_tokens

MODES = ("idc-pd", "cdc-pd", "pdd")


@dataclass(frozen=True)
class SimConfig:
    dist: str = "skewed"
    rps: float = 80.0
    requests: int = 20000
    seed: int = 0
    context_tokens: int = 65536
    output_scale: float = 1.0
    kv_bytes_per_token: int = 160_000
    wan_gbps: float = 20.0  # per WAN link
    wan_links: int = 40  # independent links; a transfer takes a random one
    wan_delay_ms: float = 20.0  # one way
    pool_streams: int = 4  # the connection pool, per link
    # PDD keeps this many streams of each pool for P-MD KV (the relay hides P-RLD-MD's).
    urgent_streams: int = 1
    stream_gbps: float = 0.0  # per-stream cap, 0 = none
    fast_gbps: float = 400.0  # P→RLD and IDC P→D, per instance
    prefill_instances: int = 40
    idc_prefill_instances: int = 36
    prefill_tokens_per_s: float = 18_000.0
    prefill_overhead_ms: float = 50.0
    md_step_ms: float = 30.0  # bandwidth-strong chip
    relay_step_ms: float = 30.0
    flagship_step_ms: float = 63.0  # 30 ms × 2.1: the flagship decodes slower
    relay_slots: int = 128
    # A relay pool fuller than this hands off one-shot; otherwise catch-up.
    relay_busy_fraction: float = 0.8
    hit_threshold: float = 0.95
    # PDD: a request whose miss is at most this many tokens goes MD (MainDecode prefills it); 0 = off.
    local_prefill_tokens: int = 0
    # A bandwidth-strong chip prefills at 81% of the flagship's speed (the report): 0.81 × 18_000.
    md_prefill_tokens_per_s: float = 14_580.0
    # Extend-decode of n tokens on MD: one MD step + n × this (100 tokens ≈ 305 ms).
    extend_ms_per_token: float = 2.75
    sla_p90_s: float = 10.0
    sla_p99_s: float = 15.0
    # Unit prices per instance-hour (flagship, bandwidth-strong chip) and per Gbps-hour of WAN.
    flagship_price: float = 1.0
    bandwidth_chip_price: float = 0.5
    wan_price_per_gbps: float = 0.002
    relay_instances: int = 4
    md_instances: int = 8
    idc_decode_instances: int = 13

    def __post_init__(self) -> None:
        if self.dist not in DISTS:
            raise ValueError(f"dist: must be one of {DISTS}, got {self.dist!r}")
        for name, value in asdict(self).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        for name in (
            "rps",
            "requests",
            "context_tokens",
            "kv_bytes_per_token",
            "wan_gbps",
            "wan_links",
            "pool_streams",
            "fast_gbps",
            "prefill_instances",
            "idc_prefill_instances",
            "prefill_tokens_per_s",
            "md_prefill_tokens_per_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("hit_threshold", "relay_busy_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.urgent_streams >= self.pool_streams:
            raise ValueError(f"urgent_streams: must be < pool_streams, got {self.urgent_streams}")
        if self.local_prefill_tokens and not self.md_instances:
            raise ValueError("md_instances: local prefill needs at least one MainDecode instance")
        if self.output_scale < 1:
            raise ValueError(f"output_scale: must be >= 1, got {self.output_scale}")


@dataclass
class _Req:
    arrival: float
    tokens: int
    hit: float
    output: int
    link: int
    ttft: float = 0.0
    queue: float = 0.0  # WAN (or fast link) pool wait
    transfer: float = 0.0  # in flight
    prefill_wait: float = 0.0  # for a free prefill instance (MD: a free MainDecode instance)
    pipeline: str = "p-md"
    rld_tokens: int = 0
    gap: float | None = None
    handoff: str = ""


def _miss(r: _Req) -> float:
    """Prompt tokens MainDecode (and prefill) lack: what prefill computes and the WAN carries."""
    return r.tokens * (1 - r.hit)


def workload(cfg: SimConfig) -> list[_Req]:
    rng = np.random.default_rng(cfg.seed)
    t = np.cumsum(rng.exponential(1.0 / cfg.rps, size=cfg.requests))
    return [
        _Req(
            arrival=float(a),
            tokens=int(cfg.context_tokens * rng.uniform(0.9, 1.1)),
            hit=sample_hit(cfg.dist, rng),
            output=sample_output_tokens(rng, cfg.output_scale),
            link=int(rng.integers(cfg.wan_links)),
        )
        for a in t
    ]


class _Fifo:
    """``servers`` identical servers, first come first served: prefill's instances, or MainDecode's."""

    def __init__(
        self,
        loop: EventLoop,
        servers: int,
        seconds: Callable[[_Req], float],
        done: Callable[[_Req], None],
    ) -> None:
        self.loop, self.seconds, self.done = loop, seconds, done
        self.free = list(range(servers))
        self.waiting: deque[tuple[_Req, float]] = deque()

    def submit(self, r: _Req) -> None:
        self.waiting.append((r, self.loop.now))
        self._start()

    def _start(self) -> None:
        while self.free and self.waiting:
            (r, since), i = self.waiting.popleft(), self.free.pop()
            r.prefill_wait = self.loop.now - since
            self.loop.at(self.loop.now + self.seconds(r), lambda r=r, i=i: self._finish(r, i))

    def _finish(self, r: _Req, i: int) -> None:
        self.free.append(i)
        self._start()
        self.done(r)


class _Run:
    def __init__(self, cfg: SimConfig, mode: str) -> None:
        self.cfg, self.mode = cfg, mode
        self.loop = EventLoop()
        n = cfg.idc_prefill_instances if mode == "idc-pd" else cfg.prefill_instances
        overhead = cfg.prefill_overhead_ms / 1000
        self.prefill = _Fifo(
            self.loop, n, lambda r: overhead + _miss(r) / cfg.prefill_tokens_per_s, self._prefilled
        )
        self.md_prefill = _Fifo(
            self.loop,
            cfg.md_instances,
            lambda r: overhead + _miss(r) / cfg.md_prefill_tokens_per_s,
            self._md_prefilled,
        )
        wan = cfg.wan_gbps * 1e9 / 8
        pdd = mode == "pdd"
        self.links = [
            SimLink(
                self.loop,
                wan,
                cfg.pool_streams,
                cfg.stream_gbps * 1e9,
                priority=pdd,
                reserved=cfg.urgent_streams if pdd else 0,
            )
            for _ in range(cfg.wan_links)
        ]
        self.fast = cfg.fast_gbps * 1e9 / 8
        self.relay_free = cfg.relay_slots
        self.fallbacks = 0
        self.wan_bytes, self.wan_transfers = 0.0, 0

    def arrive(self, r: _Req) -> None:
        lp = self.cfg.local_prefill_tokens
        if self.mode == "pdd" and lp and _miss(r) <= lp:
            r.pipeline = "md"  # the request itself crosses the WAN to MainDecode
            self.loop.at(
                self.loop.now + self.cfg.wan_delay_ms / 1000, lambda: self.md_prefill.submit(r)
            )
            return
        self.prefill.submit(r)

    def _md_prefilled(self, r: _Req) -> None:
        cfg = self.cfg
        r.ttft = self.loop.now + (cfg.md_step_ms + cfg.wan_delay_ms) / 1000 - r.arrival

    def _send(
        self, r: _Req, delta: float, landed: Callable[[float, float], None], urgent: bool
    ) -> None:
        self.wan_bytes += delta
        self.wan_transfers += 1
        self.links[r.link].submit(delta, landed, urgent=urgent)

    def _prefilled(self, r: _Req) -> None:
        cfg, now = self.cfg, self.loop.now
        delta = _miss(r) * cfg.kv_bytes_per_token
        if self.mode == "idc-pd":
            r.transfer = delta / self.fast
            r.ttft = now + r.transfer + cfg.flagship_step_ms / 1000 - r.arrival
            return
        if self.mode == "pdd" and r.hit < cfg.hit_threshold:
            if self.relay_free > 0:
                self._relay(r, delta)
                return
            self.fallbacks += 1

        def landed(queue: float, flight: float) -> None:
            r.queue, r.transfer = queue, flight
            r.ttft = self.loop.now + (cfg.md_step_ms + cfg.wan_delay_ms) / 1000 - r.arrival

        self._send(r, delta, landed, urgent=True)

    def _relay(self, r: _Req, delta: float) -> None:
        cfg, now = self.cfg, self.loop.now
        self.relay_free -= 1
        r.pipeline = "p-rld-md"
        step = cfg.relay_step_ms / 1000
        first = now + r.tokens * cfg.kv_bytes_per_token / self.fast + step
        r.ttft = first - r.arrival
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self.relay_free += 1

        self.loop.at(first + (r.output - 1) * step, release)  # the relay finished the whole output

        def landed(queue: float, flight: float) -> None:
            r.queue, r.transfer = queue, flight
            busy = 1 - self.relay_free / cfg.relay_slots > cfg.relay_busy_fraction
            r.handoff = "one-shot" if busy else "catch-up"
            k, t, gap = self._handoff(
                max(1, 1 + int((self.loop.now - first) / step)), r.output, busy
            )
            r.rld_tokens = k
            if k < r.output:
                r.gap = gap * 1000
                self.loop.at(self.loop.now + t, release)

        self._send(r, delta, landed, urgent=False)

    def _handoff(self, k: int, output: int, one_shot: bool) -> tuple[int, float, float]:
        """(relay tokens in all, seconds until the relay stops, the user-visible gap) from k relay tokens."""
        cfg = self.cfg
        extend = lambda n: (cfg.md_step_ms + n * cfg.extend_ms_per_token) / 1000  # noqa: E731
        if k >= output or one_shot:
            return min(k, output), 0.0, extend(k)
        total, t, new = k, 0.0, k
        for _ in range(16):  # catch-up: the relay keeps going while MD extends what it was sent
            e = extend(new)
            t += e
            new = int(e / (cfg.relay_step_ms / 1000))
            total += new
            if total >= output or new <= 1:
                break
        return min(total, output), t, extend(new)

    def run(self, reqs: list[_Req]) -> dict:
        for r in reqs:
            self.loop.at(r.arrival, lambda r=r: self.arrive(r))
        self.loop.run()
        return self._summary(reqs)

    def _summary(self, reqs: list[_Req]) -> dict:
        def pct(xs: Sequence[float], scale: float = 1.0) -> dict:
            a = np.asarray(xs, dtype=float) * scale
            if not len(a):
                return {"mean": None, "p50": None, "p90": None, "p99": None}
            return {
                "mean": float(a.mean()),
                **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)},
            }

        ttft = pct([r.ttft for r in reqs])
        disagg = [r for r in reqs if r.pipeline != "md"]  # MD has no prefill stage and sends no KV
        sent = [r for r in disagg if _miss(r) > 0]
        total_out = sum(r.output for r in reqs)
        horizon = max(self.loop.now, 1e-9)
        return {
            "mode": self.mode,
            "dist": self.cfg.dist,
            "rps": self.cfg.rps,
            "requests": len(reqs),
            "ttft_s": ttft,
            "kv_transfer_ms": pct([r.transfer for r in sent], 1000),
            "kv_queue_ms": pct([r.queue for r in sent], 1000),
            "prefill_wait_ms": pct([r.prefill_wait for r in disagg], 1000),
            "md_prefill_wait_ms": pct([r.prefill_wait for r in reqs if r.pipeline == "md"], 1000),
            "wan_gb": self.wan_bytes / 1e9,
            "wan_transfers": self.wan_transfers,
            "pool_saturated": float(np.mean([ln.saturated_s for ln in self.links]) / horizon),
            "rld_token_share": sum(r.rld_tokens for r in reqs) / total_out,
            "pipelines": {
                p: sum(r.pipeline == p for r in reqs) for p in ("md", "p-md", "p-rld-md")
            },
            "relay_fallbacks": self.fallbacks,
            "handoff_gap_ms": pct([r.gap for r in reqs if r.gap is not None]),
            "handoffs": {h: sum(r.handoff == h for r in reqs) for h in ("one-shot", "catch-up")},
            "sla_met": ttft["p90"] < self.cfg.sla_p90_s and ttft["p99"] < self.cfg.sla_p99_s,
        }


def simulate(cfg: SimConfig, mode: str) -> dict:
    """One run of one mode; the same config gives the same workload in every mode."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
    return _Run(cfg, mode).run(workload(cfg))


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(runs: Sequence[dict]) -> str:
    head = (
        f"{'mode':<8} {'dist':<8} {'TTFT p50/p90/p99 s':>20} {'KV xfer p50/p99 ms':>20} "
        f"{'queue mean ms':>13} {'pool sat':>8} {'RLD share':>9} {'MD reqs':>7} {'gap p99':>8} SLA"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        t, x = r["ttft_s"], r["kv_transfer_ms"]
        lines.append(
            f"{r['mode']:<8} {r['dist']:<8} "
            f"{fmt(t['p50']) + '/' + fmt(t['p90']) + '/' + fmt(t['p99']):>20} "
            f"{fmt(x['p50'], 0) + '/' + fmt(x['p99'], 0):>20} {fmt(r['kv_queue_ms']['mean'], 0):>13} "
            f"{r['pool_saturated']:>8.0%} {r['rld_token_share']:>9.1%} "
            f"{r['pipelines']['md'] / r['requests']:>7.0%} "
            f"{fmt(r['handoff_gap_ms']['p99'], 0):>8} {'yes' if r['sla_met'] else 'no'}"
        )
    return "\n".join(lines)
