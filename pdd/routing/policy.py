"""The router: which pipeline a request takes and which instances serve it.

Pure policy (no gRPC, no Redis): inputs are plain data — the live instances
with their load and the kvstore's predicted prefix hits — and a
``random.Random`` for tie-breaks, so every decision is reproducible.

Life of a decision (docs/architecture.md, "A request's path"), Filter → Scorer → Picker per role:
  1. filter: instances of the role whose KV pool still has room;
  2. score: prefix affinity (predicted cached tokens) minus a load penalty
     (prefill, main_decode), or plain load (relay — it holds no prefix);
  3. pick: the best score, ties broken by the seeded generator;
  then the pipeline: if the chosen MainDecode lacks at most
  ``local_prefill_tokens`` of the prompt → MD (it prefills that short suffix
  itself: no prefill stage, no KV on the WAN — conditional disaggregation);
  else MainDecode's predicted hit ≥ θ → P-MD, else P-RLD-MD (when a relay
  exists); the handoff mode: a busy relay → one-shot (cheap for
  the relay), an idle one → catch-up (the user's stream never stalls).
Overrides (``force_pipeline``, ``handoff_mode``) win over the policy.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd.core.instance import Instance, Role
from pdd.core.pipeline import HandoffMode, Pipeline


@dataclass(frozen=True)
class RoutingConfig:
    # MainDecode hit rate at or above which a request skips the relay.
    hit_threshold: float = 0.95
    # Predicted uncached suffix (tokens) MainDecode prefills itself; 0 = always disaggregate.
    local_prefill_tokens: int = 0
    # Tokens of predicted prefix worth one running request of load.
    tokens_per_load_unit: int = 256
    # A relay running at least this many requests hands off one-shot.
    relay_busy_requests: int = 4
    # Instances whose KV pool is fuller than this are filtered out (when others remain).
    max_kv_usage: float = 0.95

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


def route(
    prompt_len: int,
    instances: Sequence[Instance],
    cached_tokens: Mapping[str, int],
    rng: random.Random,
    config: RoutingConfig = RoutingConfig(),
    *,
    force_pipeline: Pipeline | None = None,
    force_handoff: HandoffMode | None = None,
) -> Route:
    """Choose a pipeline and its instances for a prompt of ``prompt_len`` tokens.

    ``cached_tokens`` maps instance id → predicted leading prompt tokens held.
    """
    if prompt_len <= 0:
        raise ValueError(f"prompt_len: must be positive, got {prompt_len}")
    prefill = _affinity_pick(_filter(instances, Role.PREFILL, config), cached_tokens, config, rng)
    md = _affinity_pick(_filter(instances, Role.MAIN_DECODE, config), cached_tokens, config, rng)
    md_cached = min(cached_tokens.get(md.ref.instance_id, 0), prompt_len)
    hit = md_cached / prompt_len
    relays = [i for i in instances if i.ref.role is Role.RELAY]
    if force_pipeline is not None:
        pipeline = force_pipeline
    elif config.local_prefill_tokens and prompt_len - md_cached <= config.local_prefill_tokens:
        pipeline = Pipeline.MD
    elif hit >= config.hit_threshold or not relays:
        pipeline = Pipeline.P_MD
    else:
        pipeline = Pipeline.P_RLD_MD
    relay, mode = None, None
    if pipeline is Pipeline.P_RLD_MD:
        cands = _filter(instances, Role.RELAY, config)
        relay = _pick(cands, {c.ref.instance_id: -float(_load(c)) for c in cands}, rng)
        if force_handoff is not None:
            mode = force_handoff
        else:
            busy = _load(relay) >= config.relay_busy_requests
            mode = HandoffMode.ONE_SHOT if busy else HandoffMode.CATCH_UP
    return Route(pipeline, prefill, md, relay, mode, hit, md_cached)
