"""The router: which pipeline a request takes and which instances serve it.

Pure policy (no gRPC, no Redis, no clock): inputs are plain data — the live instances with their
load, the kvstore's predicted prefix hits, the chosen prefill's measured WAN links
(``LinkState``, one per remote cluster) and the KV bytes one token takes on the WAN — and a
``random.Random`` for tie-breaks, so every decision is reproducible.

Life of a decision (docs/architecture.md, "A request's path"), Filter → Scorer → Picker per role:
  1. filter: for MainDecode under ``link_aware``, those behind a healthy (or not yet measured)
     link, while one exists; then instances of the role whose KV pool still has room;
  2. score: prefix affinity (predicted cached tokens / ``tokens_per_load_unit``) minus load
     (running + waiting requests); for MainDecode under ``link_aware`` also minus the estimated
     transfer time of its delta on its cluster's link, in units of the budget (a delta
     that would take one whole budget to cross costs as much as one running request); plain
     load for the relay (it holds no prefix);
  3. pick: the best score, ties broken by the seeded generator.
  Then the pipeline:
  - MainDecode lacks at most ``local_prefill_tokens`` of the prompt → MD (it prefills that short
    suffix itself: no prefill stage, no KV on the WAN — conditional disaggregation);
  - no relay registered → P-MD;
  - ``link_aware`` with the chosen MainDecode's link measured (and the KV size per token known):
    estimated transfer = (bytes ahead + delta bytes) / throughput + RTT, where the bytes ahead
    are the link's report drained by its age, or what the caller itself has pending on the link
    when that is more (``LinkState.transfer_s``); P-RLD-MD only when it exceeds the budget,
    else P-MD (an unhealthy link: P-RLD-MD). The budget scales with the deployment:
    ``ttft_budget_ratio`` × the reference TTFT (the first-token latency the caller measured
    recently, which no WAN transfer is in) — ``ttft_budget_s`` until one is known, or always
    when the ratio is 0 (``ttft_budget``);
  - otherwise (``threshold``, or a link not measured yet): the report's fixed θ — predicted hit
    ≥ ``hit_threshold`` → P-MD, else P-RLD-MD;
  - the guarded relay: a relay is *full* at ``relay_max_requests`` requests or a KV pool fuller
    than ``relay_max_kv_usage``; a would-be P-RLD-MD request goes P-MD when every relay is full
    (``RouteReason.RELAY_FULL``), else it takes the least loaded relay that is not full;
  and the handoff mode: a busy relay (``relay_busy_requests``) → one-shot (cheap for the relay),
  an idle one → catch-up (the user's stream never stalls).
Overrides (``force_pipeline``, ``handoff_mode``) win over the policy (and over the guard).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdd.core.instance import Instance, Role
from pdd.core.link_state import LinkState
from pdd.core.pipeline import HandoffMode, Pipeline

PIPELINE_POLICIES = ("link_aware", "threshold")


@dataclass(frozen=True)
class RoutingConfig:
    # MainDecode hit rate at or above which a request skips the relay (policy "threshold", and
    # "link_aware" while the link is not measured).
    hit_threshold: float = 0.95
    # Predicted uncached suffix (tokens) MainDecode prefills itself; 0 = always disaggregate.
    local_prefill_tokens: int = 0
    # Tokens of predicted prefix worth one running request of load.
    tokens_per_load_unit: int = 256
    # A relay running at least this many requests hands off one-shot.
    relay_busy_requests: int = 4
    # Instances whose KV pool is fuller than this are filtered out (when others remain).
    max_kv_usage: float = 0.95
    # "link_aware": P-RLD-MD only when the delta's estimated transfer exceeds the budget;
    # "threshold": the report's fixed θ on the predicted hit (hit_threshold).
    pipeline_policy: str = "link_aware"
    # Estimated seconds of WAN transfer a P-MD request may wait for its delta, in units of the
    # deployment's own recent TTFT (prefill's first token, no transfer in it). 3: the relay
    # takes only deltas that would hold the first decoded token back by several first tokens
    # (measured: README, "Two remote clusters"); 0: the absolute ttft_budget_s always.
    ttft_budget_ratio: float = 3.0
    # The budget in seconds while no reference TTFT is known (or with ttft_budget_ratio 0).
    ttft_budget_s: float = 0.5
    # A relay holding this many requests is full (the guarded relay).
    relay_max_requests: int = 32
    # A relay whose KV pool is fuller than this is full; 1.0 = never by KV.
    relay_max_kv_usage: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_threshold <= 1.0:
            raise ValueError(f"hit_threshold: must be in [0, 1], got {self.hit_threshold}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: must be >= 0, got {self.local_prefill_tokens}")
        if self.tokens_per_load_unit <= 0:
            raise ValueError(
                f"tokens_per_load_unit: must be positive, got {self.tokens_per_load_unit}"
            )
        if self.relay_busy_requests < 1:
            raise ValueError(f"relay_busy_requests: must be >= 1, got {self.relay_busy_requests}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage: must be in (0, 1], got {self.max_kv_usage}")
        if self.pipeline_policy not in PIPELINE_POLICIES:
            raise ValueError(
                f"pipeline_policy: must be one of {PIPELINE_POLICIES}, got {self.pipeline_policy!r}"
            )
        if not (math.isfinite(self.ttft_budget_s) and self.ttft_budget_s > 0):
            raise ValueError(f"ttft_budget_s: must be positive, got {self.ttft_budget_s}")
        if not (math.isfinite(self.ttft_budget_ratio) and self.ttft_budget_ratio >= 0):
            raise ValueError(
                f"ttft_budget_ratio: must be finite and >= 0, got {self.ttft_budget_ratio}"
            )
        if self.relay_max_requests < 1:
            raise ValueError(f"relay_max_requests: must be >= 1, got {self.relay_max_requests}")
        if not 0.0 < self.relay_max_kv_usage <= 1.0:
            raise ValueError(
                f"relay_max_kv_usage: must be in (0, 1], got {self.relay_max_kv_usage}"
            )

    @property
    def link_aware(self) -> bool:
        return self.pipeline_policy == "link_aware"


class RouteReason(enum.Enum):
    """Why the route has its pipeline."""

    FORCED = "forced"  # the request asked for it
    LOCAL_PREFILL = "local_prefill"  # MainDecode lacks a suffix short enough to prefill itself
    NO_RELAY = "no_relay"  # no relay registered
    HIT_THRESHOLD = "hit_threshold"  # the fixed θ on the predicted hit decided
    LINK_BUDGET = "link_budget"  # the estimated transfer against ttft_budget_s decided
    RELAY_FULL = "relay_full"  # P-RLD-MD was due but every relay is full: P-MD


@dataclass(frozen=True)
class Route:
    pipeline: Pipeline
    prefill: Instance
    main_decode: Instance
    relay: Instance | None
    handoff_mode: HandoffMode | None
    # Predicted fraction of the prompt the chosen MainDecode holds.
    predicted_hit_rate: float
    predicted_md_cached_tokens: int
    reason: RouteReason = RouteReason.HIT_THRESHOLD
    # Estimated seconds for the delta to cross the chosen MainDecode's link (None: unknown —
    # the link is not measured, or the KV size per token is not known).
    estimated_transfer_s: float | None = None
    # The budget that estimate was held against (link_aware).
    budget_s: float | None = None


class NoInstanceError(LookupError):
    """No live instance of a needed role."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no live {role.value} instance is registered")
        self.role = role


def _usage(inst: Instance) -> float:
    total = inst.load.kv_blocks_total
    return inst.load.kv_blocks_used / total if total else 0.0


def _filter(instances: Sequence[Instance], role: Role, config: RoutingConfig) -> list[Instance]:
    of_role = [i for i in instances if i.ref.role is role]
    if not of_role:
        raise NoInstanceError(role)
    roomy = [i for i in of_role if _usage(i) <= config.max_kv_usage]
    return roomy or of_role  # NOTE: all full → still route; the engine queues or preempts


def _load(inst: Instance) -> int:
    return inst.load.running_requests + inst.load.waiting_requests


def relay_full(relay: Instance, config: RoutingConfig) -> bool:
    """Whether the guarded relay admits no more requests."""
    return _load(relay) >= config.relay_max_requests or _usage(relay) > config.relay_max_kv_usage


def ttft_budget(config: RoutingConfig, reference_ttft_s: float | None) -> float:
    """Seconds of estimated transfer a P-MD request may wait for: ``ttft_budget_ratio`` × the
    deployment's reference TTFT, or ``ttft_budget_s`` while none is known (or the ratio is 0)."""
    if config.ttft_budget_ratio and reference_ttft_s is not None and reference_ttft_s > 0:
        return config.ttft_budget_ratio * reference_ttft_s
    return config.ttft_budget_s


@dataclass(frozen=True)
class LinkView:
    """What the router knows of the WAN links besides their reports: the caller's own bytes
    pending on each (by cluster) and the time now, which ages the reports."""

    pending_bytes: Mapping[str, int] = field(default_factory=dict)
    now_ms: int | None = None


def transfer_estimate(
    link: LinkState | None, delta_tokens: int, kv_bytes_per_token: int, view: LinkView = LinkView()
) -> float | None:
    """Seconds for ``delta_tokens`` of KV to cross ``link``; None when unknown (no link state,
    not measured yet, or no KV size); infinite on an unhealthy link."""
    if link is not None and not link.healthy:
        return math.inf
    if link is None or not link.measured or kv_bytes_per_token <= 0:
        return None
    pending = view.pending_bytes.get(link.cluster, 0)
    return link.transfer_s(delta_tokens * kv_bytes_per_token, view.now_ms, pending)


def _pick(cands: list[Instance], score: Mapping[str, float], rng: random.Random) -> Instance:
    best = max(score[c.ref.instance_id] for c in cands)
    tied = sorted(
        (c for c in cands if score[c.ref.instance_id] == best), key=lambda c: c.ref.instance_id
    )
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _affinity_pick(
    cands: list[Instance], cached: Mapping[str, int], config: RoutingConfig, rng: random.Random
) -> Instance:
    score = {
        c.ref.instance_id: cached.get(c.ref.instance_id, 0) / config.tokens_per_load_unit - _load(c)
        for c in cands
    }
    return _pick(cands, score, rng)


def _main_decode_pick(
    cands: list[Instance],
    cached: Mapping[str, int],
    prompt_len: int,
    links: Mapping[str, LinkState],
    kv_bytes_per_token: int,
    view: LinkView,
    budget_s: float,
    config: RoutingConfig,
    rng: random.Random,
) -> Instance:
    """Link-aware: affinity − load − estimated transfer / budget."""
    score = {}
    for c in cands:
        held = min(cached.get(c.ref.instance_id, 0), prompt_len)
        delta = prompt_len - held
        est = transfer_estimate(links.get(c.ref.cluster), delta, kv_bytes_per_token, view)
        # NOTE: an unknown estimate costs nothing (the affinity score alone, as under θ); an
        # unhealthy link is only left when every candidate's is (then its cost is no signal).
        penalty = est / budget_s if est is not None and math.isfinite(est) else 0.0
        score[c.ref.instance_id] = held / config.tokens_per_load_unit - _load(c) - penalty
    return _pick(cands, score, rng)


def route(
    prompt_len: int,
    instances: Sequence[Instance],
    cached_tokens: Mapping[str, int],
    rng: random.Random,
    config: RoutingConfig = RoutingConfig(),
    *,
    force_pipeline: Pipeline | None = None,
    force_handoff: HandoffMode | None = None,
    links: Mapping[str, LinkState] | Sequence[LinkState] | None = None,
    kv_bytes_per_token: int = 0,
    link_view: LinkView = LinkView(),
    reference_ttft_s: float | None = None,
) -> Route:
    """Choose a pipeline and its instances for a prompt of ``prompt_len`` tokens.

    ``cached_tokens`` maps instance id → predicted leading prompt tokens held. ``links``: the
    WAN links' states by remote cluster (default: what the chosen prefill reported, its
    ``load.links``). ``kv_bytes_per_token``: KV bytes one prompt token takes on the WAN (0:
    unknown — ``link_aware`` then decides by θ). ``link_view``: the caller's own bytes pending
    on each link and the time now (``LinkView``). ``reference_ttft_s``: the deployment's recent
    first-token latency, which scales the budget (``ttft_budget``).
    """
    if prompt_len <= 0:
        raise ValueError(f"prompt_len: must be positive, got {prompt_len}")
    if kv_bytes_per_token < 0:
        raise ValueError(f"kv_bytes_per_token: must be >= 0, got {kv_bytes_per_token}")
    prefill = _affinity_pick(_filter(instances, Role.PREFILL, config), cached_tokens, config, rng)
    if links is None:
        links = prefill.load.links
    by_cluster = dict(links) if isinstance(links, Mapping) else {lk.cluster: lk for lk in links}
    budget_s = ttft_budget(config, reference_ttft_s)
    if config.link_aware:
        mds = [i for i in instances if i.ref.role is Role.MAIN_DECODE]
        healthy = [m for m in mds if (lk := by_cluster.get(m.ref.cluster)) is None or lk.healthy]
        # NOTE: never behind an unhealthy link while a healthy one exists — before the KV filter:
        # a full pool queues, a dead link never delivers.
        mds = _filter(healthy or mds, Role.MAIN_DECODE, config)
        md = _main_decode_pick(
            mds,
            cached_tokens,
            prompt_len,
            by_cluster,
            kv_bytes_per_token,
            link_view,
            budget_s,
            config,
            rng,
        )
    else:
        md = _affinity_pick(
            _filter(instances, Role.MAIN_DECODE, config), cached_tokens, config, rng
        )
    md_cached = min(cached_tokens.get(md.ref.instance_id, 0), prompt_len)
    hit = md_cached / prompt_len
    est = transfer_estimate(
        by_cluster.get(md.ref.cluster), prompt_len - md_cached, kv_bytes_per_token, link_view
    )
    relays = [i for i in instances if i.ref.role is Role.RELAY]
    if force_pipeline is not None:
        pipeline, reason = force_pipeline, RouteReason.FORCED
    elif config.local_prefill_tokens and prompt_len - md_cached <= config.local_prefill_tokens:
        pipeline, reason = Pipeline.MD, RouteReason.LOCAL_PREFILL
    elif not relays:
        pipeline, reason = Pipeline.P_MD, RouteReason.NO_RELAY
    elif config.link_aware and est is not None:
        slow = est > budget_s
        pipeline, reason = (Pipeline.P_RLD_MD if slow else Pipeline.P_MD), RouteReason.LINK_BUDGET
    else:
        pipeline = Pipeline.P_MD if hit >= config.hit_threshold else Pipeline.P_RLD_MD
        reason = RouteReason.HIT_THRESHOLD
    relay, mode = None, None
    if pipeline is Pipeline.P_RLD_MD:
        if reason is not RouteReason.FORCED:
            # NOTE: the guard first (over every relay), then the usual filter among the open ones.
            relays = [r for r in relays if not relay_full(r, config)]
        if not relays:
            pipeline, reason = Pipeline.P_MD, RouteReason.RELAY_FULL
        else:
            cands = _filter(relays, Role.RELAY, config)
            relay = _pick(cands, {c.ref.instance_id: -float(_load(c)) for c in cands}, rng)
            if force_handoff is not None:
                mode = force_handoff
            else:
                busy = _load(relay) >= config.relay_busy_requests
                mode = HandoffMode.ONE_SHOT if busy else HandoffMode.CATCH_UP
    return Route(pipeline, prefill, md, relay, mode, hit, md_cached, reason, est, budget_s)
