"""Discrete-event simulator of IDC-PD, CDC-PD and PDD at the report's scale (or the testbed's).

Every request is routed by ``pdd.routing.policy.route`` — the live gateway's policy — over the
simulated instances' loads and their caches' real contents; what a route costs comes from a chip
profile (``sim_profile``: step times by batch and context, KV budgets) and the links.

Life of a request (times in seconds; ``TTFT`` is the first token a *decode* stage produced at the
client, the report's TTFT and the bench's TTFDT):
  arrive     after the session's previous turn is done (agents wait); the router picks prefill,
             MainDecode (and a relay), the pipeline and the handoff mode; MainDecode locks the
             prefix its DRC holds (its hit is what the router saw).
             The stack's own cost per request (the profile's ``request_overhead_ms``, measured on
             the testbed by ``pdd bench calibrate --stack``; 0 at the report's scale) delays the
             first stage.
  prefill    (P-MD, P-RLD-MD) a ``PrefillInstance`` computes what *its own* cache lacks (prompts
             only: a later turn recomputes the previous output) in chunked, batched steps; each
             chunk's KV streams out as it is computed (``sim_push``; ``stream_kv=False``: after).
  IDC-PD     the delta crosses the fast link to a flagship decode instance, which decodes.
  CDC-PD     the delta MainDecode lacks crosses the remote cluster's WAN link (``SimLink``: a FIFO
             connection pool of ``pool_streams`` streams sharing the bandwidth TCP-fairly), then
             the one-way delay; MainDecode decodes; its tokens take the delay back.
  PDD        MD: the prompt crosses the WAN; MainDecode prefills its miss inside its decode steps.
             P-MD: as CDC-PD. P-RLD-MD: the whole KV crosses the fast link to a relay, which
             decodes at once; the delta crosses the WAN behind it; when it lands MainDecode tells
             the relay (one delay), which hands off token ids (one delay): one-shot (the relay
             stops; MainDecode extends its k tokens and speaks) or catch-up (the relay keeps going
             while MainDecode extends, rounds until it is level). A relay that finished first still
             hands its tokens over, so the DRC holds prompt + output for the session's next turn.
  end        MainDecode puts prompt + output in its DRC (LRU), prefill its prompt in its cache.
Requests that arrive in the first ``warmup_s`` (cold caches) are run but not measured.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from pdd.bench.sim_config import SimConfig
from pdd.bench.sim_engine import DecodeInstance, PrefillInstance, Seq
from pdd.bench.sim_link import EventLoop, SimLink
from pdd.bench.sim_profile import Profile, load_profile
from pdd.bench.sim_push import FastPush, WanPush
from pdd.bench.sim_summary import summarize
from pdd.bench.sim_workload import SimRequest, sessions
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.link_state import LinkState
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.routing.policy import route
from pdd.serving.membership import DEFAULT_LEASE_TTL_MS, HEARTBEATS_PER_LEASE
from pdd.serving.route_ledger import RouteLedger

# How often an instance reports its load (prefill: its links' state).
HEARTBEAT_S = DEFAULT_LEASE_TTL_MS / 1000 / HEARTBEATS_PER_LEASE

MODES = ("idc-pd", "cdc-pd", "pdd")


def _ignore(_: float) -> None:
    return None


BLOCK = 16  # tokens per KV block, for the router's view of KV usage
CATCH_UP_GAP = 8  # the relay's --catch-up-gap: stop once MainDecode is this close
MAX_ROUNDS = 8


@dataclass(eq=False)
class Outcome:
    """What happened to one request (times in seconds from its arrival)."""

    req: SimRequest
    start: float = 0.0
    pipeline: str = ""
    handoff: str = ""
    hit: float = 0.0  # MainDecode's actual hit (what it held)
    ttft: float | None = None
    e2e: float | None = None
    queue: float = 0.0  # WAN connection-pool wait
    transfer: float = 0.0  # WAN in flight
    sent_tokens: int = 0
    rld_tokens: int = 0
    md_tokens: int = 0
    gap: float | None = None
    relay_done: bool = False
    relay_last: float = 0.0
    rounds: int = 0  # catch-up rounds MainDecode extended
    extended: int = 0  # relay tokens sent to MainDecode in those rounds
    # Simulation state, not results.
    md: DecodeInstance | None = field(default=None, repr=False)
    locked: int = field(default=0, repr=False)
    relay: DecodeInstance | None = field(default=None, repr=False)
    relay_seq: Seq | None = field(default=None, repr=False)


class _Run:
    def __init__(self, cfg: SimConfig, mode: str, profile: Profile) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
        self.cfg, self.mode, self.profile = cfg, mode, profile
        self.loop = EventLoop()
        self.rng = random.Random(cfg.seed)
        self.router = cfg.routing()
        link = profile.link
        self.delay = (cfg.wan_delay_ms if cfg.wan_delay_ms >= 0 else link.wan_delay_ms) / 1e3
        self.fast = link.fast_gbps * 1e9 / 8
        self.overhead = profile.request_overhead_ms / 1e3
        self.overhead_md = profile.md_request_overhead_ms / 1e3
        self.kv = (cfg.kv_bytes_per_token or profile.kv_bytes_per_token) * profile.kv_wire_ratio
        idc = mode == "idc-pd"
        n_p = cfg.idc_prefill_instances if idc else cfg.prefill_instances
        pchip = profile.chip(cfg.prefill_chip)
        # NOTE: the served prefill's compute (the engine's, times what the stage adds per token)
        f = profile.prefill_stack_factor
        pchip = replace(pchip, prefill_tokens_per_s=pchip.prefill_tokens_per_s / f)
        self.prefill = [PrefillInstance(self.loop, pchip, f"p{i}") for i in range(n_p)]
        dchip = profile.chip(cfg.idc_decode_chip if idc else cfg.md_chip)
        if cfg.md_chunk_tokens:
            dchip = replace(dchip, prefill_chunk_tokens=cfg.md_chunk_tokens)
        n_md = cfg.idc_decode_instances if idc else cfg.md_instances
        stream = profile.md_stream_ms_per_step
        self.mds = [DecodeInstance(self.loop, dchip, f"md{i}", stream) for i in range(n_md)]
        rchip = profile.chip(cfg.relay_chip)
        n_r = cfg.relay_instances if mode == "pdd" else 0
        stream = profile.relay_stream_ms_per_step
        self.relays = [DecodeInstance(self.loop, rchip, f"rld{i}", stream) for i in range(n_r)]
        wan = (cfg.wan_gbps or link.wan_gbps) * 1e9 / 8
        streams = cfg.pool_streams or link.pool_streams
        self.links = [SimLink(self.loop, wan, streams) for _ in range(cfg.remote_clusters)]
        self.cluster = {md.name: i % cfg.remote_clusters for i, md in enumerate(self.mds)}
        roles = [(p, Role.PREFILL) for p in self.prefill] + [
            (m, Role.MAIN_DECODE) for m in self.mds
        ]
        roles += [(r, Role.RELAY) for r in self.relays]
        self.roles = roles
        self.by_name = {inst.name: inst for inst, _ in roles}
        # NOTE: MainDecode i sits in remote cluster i % remote_clusters, behind that link.
        where = {name: f"remote{c}" for name, c in self.cluster.items()}
        self.refs = {
            inst.name: InstanceRef(inst.name, f"{inst.name}:0", role, where.get(inst.name, "main"))
            for inst, role in roles
        }
        self._views: dict[str, tuple[tuple, Instance]] = {}
        self.outcomes: list[Outcome] = []
        # Recent first-token latencies: the link-aware router's reference, as the gateway keeps.
        self.ttfts = RouteLedger()
        # The links' throughput as prefill last reported it (a heartbeat's news), and when next.
        self._reported = [0.0] * len(self.links)
        self._report_due = 0.0
        self.wan_bytes = 0.0

    # --- routing ------------------------------------------------------------------------------
    def _view(self, inst) -> Instance:
        running, waiting = inst.load()
        if isinstance(inst, DecodeInstance):
            used, total = inst.used // BLOCK, inst.chip.kv_budget_tokens // BLOCK
        else:
            used, total = 0, 0
        key = (running, waiting, used, total)
        seen = self._views.get(inst.name)
        if seen is None or seen[0] != key:
            load = InstanceLoad(running, waiting, used, total)
            seen = (key, Instance(self.refs[inst.name], BLOCK, load=load))
            self._views[inst.name] = seen
        return seen[1]

    def _route(self, r: SimRequest):
        cached = {
            inst.name: inst.cache.held(r.session, r.reuse, r.system) for inst, _ in self.roles
        }
        views = [self._view(inst) for inst, _ in self.roles]
        force = None if self.mode == "pdd" else Pipeline.P_MD
        links = None
        if self.router.link_aware:
            for ln in self.links:
                ln.sync()
            now = self.loop.now
            if now >= self._report_due:  # NOTE: prefill reports its links once a heartbeat
                self._reported = [ln.measured_bps for ln in self.links]
                self._report_due = now + HEARTBEAT_S
            # NOTE: the throughput as last reported; the bytes ahead exact — the gateway's ledger
            # knows its own pushes at once (one gateway here)
            links = [
                LinkState(f"remote{i}", bps, int(ln.outstanding), rtt_s=2 * self.delay)
                for i, (ln, bps) in enumerate(zip(self.links, self._reported))
            ]
        return route(
            r.prompt,
            views,
            cached,
            self.rng,
            self.router,
            force_pipeline=force,
            links=links,
            kv_bytes_per_token=int(round(self.kv)),
            reference_ttft_s=self.ttfts.reference_ttft_s(),
        )

    # --- a request's life ---------------------------------------------------------------------
    def arrive(self, o: Outcome) -> None:
        r = o.req
        o.start = self.loop.now
        rt = self._route(r)
        md = self.by_name[rt.main_decode.ref.instance_id]
        held, o.locked = md.lock(r.session, r.reuse, r.system)
        o.md, o.hit, o.pipeline = md, held / r.prompt, rt.pipeline.value
        if rt.pipeline is Pipeline.MD:
            seq = self._md_seq(o, prefill=r.prompt - held, tokens=r.output - 1)
            o.md_tokens = r.output
            # NOTE: the stack's own cost per request (measured) comes before any stage computes.
            self.loop.at(self.loop.now + self.delay + self.overhead_md, lambda: md.submit(seq))
            return
        p = self.by_name[rt.prefill.ref.instance_id]
        p_held = p.cache.held(r.session, r.reuse, r.system)
        relay = self.by_name[rt.relay.ref.instance_id] if rt.relay is not None else None
        if rt.handoff_mode is not None:
            o.handoff = rt.handoff_mode.value

        pushes = self._pushes(o, held, relay)

        def computed(upto: int) -> None:
            for push in pushes:
                push.feed(min(upto, r.prompt))

        def prefilled(_: float) -> None:
            p.put(r.session, r.prompt, r.system)
            for push in pushes:
                push.feed(r.prompt)
                push.close()

        def start() -> None:
            if self.cfg.stream_kv:
                computed(p_held)  # what prefill's cache already holds goes at once
            p.submit(r.prompt - p_held, p_held, prefilled, computed if self.cfg.stream_kv else None)

        if self.overhead:
            self.loop.at(self.loop.now + self.overhead, start)
        else:
            start()

    def _md_seq(self, o: Outcome, prefill: int = 0, tokens: int = 0, first=None) -> Seq:
        r = o.req
        locked, o.locked = o.locked, 0
        return Seq(
            ctx=r.prompt + (r.output - 1 - tokens),
            tokens=max(0, tokens),
            reserve=r.prompt + r.output,
            prefill=prefill,
            locked=locked,
            first=first or (lambda t: self._first(o, t, self.delay)),
            done=lambda t: self._finish(o, t),
        )

    def _first(self, o: Outcome, t: float, back: float) -> None:
        if o.ttft is None:
            o.ttft = t + back - o.start
            self.ttfts.observe_ttft(o.ttft)

    def _finish(self, o: Outcome, t: float) -> None:
        r = o.req
        o.md.put(r.session, r.prompt + r.output, r.system)
        o.e2e = t + (0 if self.mode == "idc-pd" else self.delay) - o.start
        self._release(r)

    def _pushes(self, o: Outcome, held: int, relay: DecodeInstance | None) -> list:
        """Where the request's KV goes as prefill computes it, and what happens when it is there."""
        r = o.req
        o.sent_tokens = r.prompt - held
        if self.mode == "idc-pd":
            seq = self._md_seq(o, tokens=r.output - 1, first=lambda t: self._first(o, t, 0.0))
            o.md_tokens = r.output - 1
            return [FastPush(self.loop, self.fast, self.kv, held, lambda: o.md.submit(seq))]
        if relay is None:
            o.md_tokens = r.output - 1
            return [self._wan(o, held, lambda: o.md.submit(self._md_seq(o, tokens=r.output - 1)))]
        o.relay = relay
        o.relay_seq = Seq(
            ctx=r.prompt,
            tokens=r.output - 1,
            reserve=r.prompt + r.output,
            first=lambda t: self._first(o, t, 0.0),
            done=lambda t: self._relay_done(o, t),
        )
        fast = FastPush(self.loop, self.fast, self.kv, 0, lambda: relay.submit(o.relay_seq))
        return [fast, self._wan(o, held, lambda: self._ready(o))]

    def _wan(self, o: Outcome, held: int, landed) -> WanPush:
        """The delta over the MainDecode's cluster link, then the one-way delay; then ``landed``."""
        self.wan_bytes += (o.req.prompt - held) * self.kv

        def done() -> None:
            o.queue, o.transfer = push.queue, push.flight
            self.loop.at(self.loop.now + self.delay, landed)

        push = WanPush(self.loop, self.links[self.cluster[o.md.name]], self.kv, held, done)
        push.expect((o.req.prompt - held) * self.kv)
        return push

    def _relay_done(self, o: Outcome, t: float) -> None:
        o.relay_done, o.relay_last = True, t
        o.rld_tokens = o.req.output - 1

    def _ready(self, o: Outcome) -> None:
        """The relay hears MainDecode holds the KV (one delay after it landed) and hands off."""
        r, relay = o.req, o.relay
        if o.relay_done:  # finished on the relay: MainDecode extends the output into its DRC
            o.md.submit(self._md_seq(o, prefill=max(1, r.output - 1), first=_ignore))
            return
        if o.handoff == HandoffMode.ONE_SHOT.value:
            self._final(o)
            return
        k = relay.produced(o.relay_seq, self.loop.now)
        self._round(o, k, k)

    def _round(self, o: Outcome, sent: int, new: int) -> None:
        """Catch-up: MainDecode extends ``new`` more relay tokens while the relay keeps going."""
        r, md = o.req, o.md

        def extended(_: float) -> None:
            if o.relay_done:  # the relay finished meanwhile: MainDecode extends the rest silently
                rest = self._md_seq(o, prefill=max(1, r.output - 1 - sent), first=_ignore)
                rest.held = rest.reserve
                md.submit(rest)
                return
            k = o.relay.produced(o.relay_seq, self.loop.now + self.delay)
            if k - sent <= CATCH_UP_GAP or o.rounds >= MAX_ROUNDS:
                self._final(o)
            else:
                self._round(o, k, k - sent)

        if o.rounds == 0:
            seq = self._md_seq(o, prefill=max(1, new), first=_ignore)
            seq.hold = True
        else:
            seq = Seq(ctx=0, tokens=0, reserve=0, prefill=max(1, new))
        seq.done = extended
        o.rounds, o.extended = o.rounds + 1, sent
        self.loop.at(self.loop.now + self.delay, lambda: md.submit(seq))

    def _final(self, o: Outcome) -> None:
        """The relay stops; MainDecode extends the rest and speaks from the next position."""
        r = o.req
        k = o.relay.stop(o.relay_seq)
        o.rld_tokens = k
        i = o.relay_seq.start_step + k - 1
        o.relay_last = o.relay.step_ends[i] if k and i < len(o.relay.step_ends) else self.loop.now
        left = r.output - 1 - k
        o.md_tokens = left
        new = max(1, k - o.extended)

        def first(t: float) -> None:
            # NOTE: MainDecode's token takes the delay back; the relay's took none.
            o.gap = t + self.delay - o.relay_last
            self._first(o, t, self.delay)  # the relay was stopped before its first token

        if left <= 0:
            o.relay_done = True
            seq = self._md_seq(o, prefill=new, first=_ignore)
        else:
            seq = self._md_seq(o, prefill=new, tokens=left - 1, first=first)
        if o.rounds:
            seq.held = seq.reserve  # the first catch-up round reserved it
        self.loop.at(self.loop.now + self.delay, lambda: o.md.submit(seq))

    # --- sessions -----------------------------------------------------------------------------
    def run(self, reqs: list[SimRequest]) -> dict:
        self.outcomes = [Outcome(r) for r in reqs]
        self.waiting_on: dict[int, Outcome] = {}
        for o in self.outcomes:
            if o.req.prev >= 0:
                self.waiting_on[o.req.prev] = o
            else:
                self.loop.at(o.req.arrival, lambda o=o: self.arrive(o))
        self.loop.run()
        return summarize(self, self.outcomes)

    def _release(self, r: SimRequest) -> None:
        nxt = self.waiting_on.pop(r.rid, None)
        if nxt is not None:
            self.loop.at(max(self.loop.now, nxt.req.arrival), lambda: self.arrive(nxt))


def workload(cfg: SimConfig) -> list[SimRequest]:
    return sessions(
        rps=cfg.rps,
        duration_s=cfg.duration_s,
        dist=cfg.dist,
        seed=cfg.seed,
        context_tokens=cfg.context_tokens,
        live_sessions=cfg.live_sessions,
        output_tokens=cfg.output_tokens,
        output_scale=cfg.output_scale,
    )


def simulate(
    cfg: SimConfig,
    mode: str,
    requests: list[SimRequest] | None = None,
    profile: Profile | None = None,
) -> dict:
    """One run of one mode; the same config gives the same workload in every mode."""
    prof = profile or load_profile(cfg.profile)
    return _Run(cfg, mode, prof).run(workload(cfg) if requests is None else requests)


def at_rps(cfg: SimConfig, rps: float) -> SimConfig:
    return replace(cfg, rps=rps)
