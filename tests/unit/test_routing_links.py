"""The link-aware router and the guarded relay against a slow, obviously-correct reference: every
candidate enumerated, every cost computed longhand; plus the rules one at a time (the budget,
θ while a link is unmeasured, unhealthy links, a session sticking to its cluster, a full relay)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.link_state import LinkState
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.routing.policy import LinkView, RouteReason, RoutingConfig, route

BPT = 1000  # KV bytes per token


def inst(iid, role, cluster="main", running=0, used=0, total=100, links=()):
    return Instance(
        InstanceRef(iid, "127.0.0.1:1", role, cluster),
        16,
        load=InstanceLoad(running, 0, used, total, tuple(links)),
    )


# --- the reference ------------------------------------------------------------------------------


def ref_usage(i):
    return i.load.kv_blocks_used / i.load.kv_blocks_total if i.load.kv_blocks_total else 0.0


def ref_load(i):
    return i.load.running_requests + i.load.waiting_requests


def ref_estimate(link, delta_tokens, bpt, view=LinkView()):
    """Seconds for the delta to cross, longhand; None unknown; inf unhealthy."""
    if link is not None and not link.healthy:
        return math.inf
    if link is None or link.throughput_bps <= 0 or bpt <= 0:
        return None
    ahead = link.queued_bytes + link.in_flight_bytes
    if view.now_ms is not None and link.measured_at_ms:
        # what was ahead at the report has been crossing since, at the measured rate
        age_s = max(0, view.now_ms - link.measured_at_ms) / 1000
        ahead = max(0.0, ahead - link.throughput_bps * age_s)
    ahead = max(ahead, view.pending_bytes.get(link.cluster, 0))
    return ahead / link.throughput_bps + delta_tokens * bpt / link.throughput_bps + link.rtt_s


def ref_budget(cfg, reference):
    if cfg.ttft_budget_ratio > 0 and reference:
        return cfg.ttft_budget_ratio * reference
    return cfg.ttft_budget_s


def ref_best_main_decodes(
    instances, cached, prompt_len, links, bpt, cfg, view=LinkView(), ref=None
):
    """The set of best-scoring MainDecodes, every candidate enumerated."""
    mds = [i for i in instances if i.ref.role is Role.MAIN_DECODE]
    ok = [i for i in mds if links.get(i.ref.cluster) is None or links[i.ref.cluster].healthy]
    mds = ok or mds
    mds = [i for i in mds if ref_usage(i) <= cfg.max_kv_usage] or mds
    scores = {}
    for m in mds:
        held = min(cached.get(m.ref.instance_id, 0), prompt_len)
        est = ref_estimate(links.get(m.ref.cluster), prompt_len - held, bpt, view)
        cost = 0.0 if est is None or est == math.inf else est / ref_budget(cfg, ref)
        scores[m.ref.instance_id] = held / cfg.tokens_per_load_unit - ref_load(m) - cost
    top = max(scores.values())
    return {k for k, v in scores.items() if v == top}


def ref_pipeline(md, instances, cached, prompt_len, links, bpt, cfg, view=LinkView(), ref=None):
    """(pipeline, reason, estimate) for the chosen MainDecode, rule by rule."""
    held = min(cached.get(md.ref.instance_id, 0), prompt_len)
    est = ref_estimate(links.get(md.ref.cluster), prompt_len - held, bpt, view)
    relays = [i for i in instances if i.ref.role is Role.RELAY]
    if cfg.local_prefill_tokens and prompt_len - held <= cfg.local_prefill_tokens:
        return Pipeline.MD, RouteReason.LOCAL_PREFILL, est
    if not relays:
        return Pipeline.P_MD, RouteReason.NO_RELAY, est
    if cfg.pipeline_policy == "link_aware" and est is not None:
        want, why = (
            (Pipeline.P_RLD_MD if est > ref_budget(cfg, ref) else Pipeline.P_MD),
            RouteReason.LINK_BUDGET,
        )
    else:
        want = Pipeline.P_MD if held / prompt_len >= cfg.hit_threshold else Pipeline.P_RLD_MD
        why = RouteReason.HIT_THRESHOLD
    if want is Pipeline.P_RLD_MD:
        open_ = [
            r
            for r in relays
            if ref_load(r) < cfg.relay_max_requests and ref_usage(r) <= cfg.relay_max_kv_usage
        ]
        if not open_:
            return Pipeline.P_MD, RouteReason.RELAY_FULL, est
    return want, why, est


def ref_best_relays(instances, cfg):
    open_ = [
        r
        for r in instances
        if r.ref.role is Role.RELAY
        and ref_load(r) < cfg.relay_max_requests
        and ref_usage(r) <= cfg.relay_max_kv_usage
    ]
    roomy = [r for r in open_ if ref_usage(r) <= cfg.max_kv_usage] or open_
    top = max(-ref_load(r) for r in roomy)
    return {r.ref.instance_id for r in roomy if -ref_load(r) == top}


# --- the property -------------------------------------------------------------------------------

links_st = st.builds(
    LinkState,
    cluster=st.just("x"),
    throughput_bps=st.sampled_from([0.0, 1e4, 1e6, 1e8]),
    queued_bytes=st.integers(0, 10**7),
    in_flight_bytes=st.integers(0, 10**6),
    rtt_s=st.sampled_from([0.0, 0.001, 0.05, 0.3]),
    measured_at_ms=st.sampled_from([0, 1_000, 5_000]),
    healthy=st.booleans(),
)
CLUSTERS = ["east", "west", "north"]


@settings(max_examples=300, deadline=None)
@given(
    mds=st.lists(
        st.tuples(st.sampled_from(CLUSTERS), st.integers(0, 6), st.integers(0, 100)),
        min_size=1,
        max_size=6,
    ),
    relays=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 100)), max_size=3),
    links=st.dictionaries(st.sampled_from(CLUSTERS), links_st, max_size=3),
    prompt_len=st.integers(1, 4096),
    cached_seed=st.integers(0, 2**32),
    seed=st.integers(0, 2**32),
    policy=st.sampled_from(["link_aware", "threshold"]),
    budget=st.sampled_from([0.05, 0.5, 5.0]),
    ratio=st.sampled_from([0.0, 0.5, 2.0]),
    reference=st.sampled_from([None, 0.02, 0.3]),
    now_ms=st.sampled_from([None, 1_000, 1_500, 30_000]),
    pending=st.dictionaries(st.sampled_from(CLUSTERS), st.integers(0, 10**7), max_size=3),
    relay_cap=st.integers(1, 4),
    relay_kv=st.sampled_from([0.5, 0.9, 1.0]),
    bpt=st.sampled_from([0, BPT]),
    local=st.sampled_from([0, 64]),
)
def test_route_matches_the_reference(
    mds,
    relays,
    links,
    prompt_len,
    cached_seed,
    seed,
    policy,
    budget,
    ratio,
    reference,
    now_ms,
    pending,
    relay_cap,
    relay_kv,
    bpt,
    local,
):
    links = {c: LinkState(c, *list(vars(lk).values())[1:]) for c, lk in links.items()}
    instances = [inst("p", Role.PREFILL, links=links.values())]
    instances += [
        inst(f"md-{i}", Role.MAIN_DECODE, c, run, used) for i, (c, run, used) in enumerate(mds)
    ]
    instances += [inst(f"rld-{i}", Role.RELAY, "main", r, u) for i, (r, u) in enumerate(relays)]
    crng = random.Random(cached_seed)
    cached = {i.ref.instance_id: crng.randrange(0, prompt_len + 1, 16) for i in instances}
    cfg = RoutingConfig(
        local_prefill_tokens=local,
        pipeline_policy=policy,
        ttft_budget_s=budget,
        ttft_budget_ratio=ratio,
        relay_max_requests=relay_cap,
        relay_max_kv_usage=relay_kv,
    )
    view = LinkView(pending, now_ms)
    known = dict(kv_bytes_per_token=bpt, link_view=view, reference_ttft_s=reference)
    r = route(prompt_len, instances, cached, random.Random(seed), cfg, **known)
    if policy == "link_aware":
        best = ref_best_main_decodes(
            instances, cached, prompt_len, links, bpt, cfg, view, reference
        )
        assert r.main_decode.ref.instance_id in best
        if any(c not in links or links[c].healthy for c, _, _ in mds):
            # never behind an unhealthy link while a healthy (or unmeasured) one exists
            chosen = links.get(r.main_decode.ref.cluster)
            assert chosen is None or chosen.healthy
    pipeline, reason, est = ref_pipeline(
        r.main_decode, instances, cached, prompt_len, links, bpt, cfg, view, reference
    )
    assert (r.pipeline, r.reason) == (pipeline, reason)
    assert r.estimated_transfer_s == (pytest.approx(est) if est not in (None, math.inf) else est)
    if pipeline is Pipeline.P_RLD_MD:
        assert r.relay.ref.instance_id in ref_best_relays(instances, cfg)
        busy = ref_load(r.relay) >= cfg.relay_busy_requests
        assert r.handoff_mode is (HandoffMode.ONE_SHOT if busy else HandoffMode.CATCH_UP)
    else:
        assert r.relay is None and r.handoff_mode is None
    assert route(prompt_len, instances, cached, random.Random(seed), cfg, **known) == r


# --- the rules, one at a time -------------------------------------------------------------------


def stack(link: LinkState | None, *mds: Instance, relays=1) -> list[Instance]:
    p = inst("p", Role.PREFILL, links=[link] if link else [])
    return [p, *mds, *(inst(f"rld-{i}", Role.RELAY) for i in range(relays))]


def test_the_budget_decides_not_the_hit():
    md = inst("md", Role.MAIN_DECODE, "remote")
    fast = LinkState("remote", throughput_bps=1e9, rtt_s=0.01)
    slow = LinkState("remote", throughput_bps=1e5, rtt_s=0.01)
    cfg = RoutingConfig(ttft_budget_s=0.5)
    rng = random.Random(0)
    # hit 0.5 (θ would send it through the relay): 2048 tokens × 1 kB over 1 GB/s = 2 ms → P-MD
    r = route(4096, stack(fast, md), {"md": 2048}, rng, cfg, kv_bytes_per_token=BPT)
    assert (r.pipeline, r.reason) == (Pipeline.P_MD, RouteReason.LINK_BUDGET)
    assert r.estimated_transfer_s == pytest.approx(2048 * BPT / 1e9 + 0.01)
    # hit 0.98 (θ would go P-MD): 82 tokens × 1 kB over 100 kB/s = 0.82 s > 0.5 s → relay
    r = route(4096, stack(slow, md), {"md": 4014}, rng, cfg, kv_bytes_per_token=BPT)
    assert (r.pipeline, r.reason) == (Pipeline.P_RLD_MD, RouteReason.LINK_BUDGET)
    # a full connection pool ahead of a small delta is what pushes it over
    queued = LinkState("remote", throughput_bps=1e9, queued_bytes=10**9, rtt_s=0.01)
    r = route(4096, stack(queued, md), {"md": 4096 - 16}, rng, cfg, kv_bytes_per_token=BPT)
    assert r.pipeline is Pipeline.P_RLD_MD and r.estimated_transfer_s > 1.0


def test_the_budget_scales_with_the_deployments_own_ttft():
    md = inst("md", Role.MAIN_DECODE, "remote")
    link = LinkState("remote", throughput_bps=1e6, rtt_s=0.01)  # 190 tokens × 1 kB: 0.2 s
    rng = random.Random(0)

    def budget(cfg, reference):
        r = route(
            4096,
            stack(link, md),
            {"md": 4096 - 190},
            rng,
            cfg,
            **dict(kv_bytes_per_token=BPT, reference_ttft_s=reference),
        )
        assert r.estimated_transfer_s == pytest.approx(0.2)
        return r.budget_s, r.pipeline

    cfg = RoutingConfig(ttft_budget_s=0.5, ttft_budget_ratio=2.0)
    # a testbed whose first token takes 50 ms: 0.2 s of transfer is worth the relay
    assert budget(cfg, 0.05) == (pytest.approx(0.1), Pipeline.P_RLD_MD)
    # a deployment whose first token takes seconds: the same transfer hides behind it
    assert budget(cfg, 2.0) == (pytest.approx(4.0), Pipeline.P_MD)
    # nothing measured yet, or the ratio off: the absolute budget
    assert budget(cfg, None) == (0.5, Pipeline.P_MD)
    assert budget(replace(cfg, ttft_budget_ratio=0.0), 0.05) == (0.5, Pipeline.P_MD)


def test_an_old_report_has_drained_and_the_callers_own_bytes_count():
    md = inst("md", Role.MAIN_DECODE, "remote")
    # 1 MB ahead at 1 MB/s when reported at t = 10 s
    link = LinkState("remote", throughput_bps=1e6, queued_bytes=10**6, measured_at_ms=10_000)
    rng = random.Random(0)

    def est(view):
        r = route(100, stack(link, md), {"md": 100}, rng, kv_bytes_per_token=BPT, link_view=view)
        return r.estimated_transfer_s

    assert est(LinkView()) == pytest.approx(1.0)  # no clock: the report as it is
    assert est(LinkView(now_ms=10_000)) == pytest.approx(1.0)
    assert est(LinkView(now_ms=10_400)) == pytest.approx(0.6)  # 0.4 s crossed since
    assert est(LinkView(now_ms=12_000)) == pytest.approx(0.0)  # all of it
    assert est(LinkView(now_ms=9_000)) == pytest.approx(1.0)  # a clock behind: no younger
    # what the caller itself sent and has not seen cross, when that is more
    assert est(LinkView({"remote": 3 * 10**5}, 12_000)) == pytest.approx(0.3)
    assert est(LinkView({"remote": 3 * 10**5}, 10_000)) == pytest.approx(1.0)
    assert est(LinkView({"elsewhere": 10**9}, 12_000)) == pytest.approx(0.0)


def test_unmeasured_link_or_unknown_kv_size_falls_back_to_theta():
    md = inst("md", Role.MAIN_DECODE, "remote")
    rng = random.Random(0)
    for link, bpt in [(None, BPT), (LinkState("remote"), BPT), (LinkState("remote", 1e9), 0)]:
        r = route(100, stack(link, md), {"md": 50}, rng, kv_bytes_per_token=bpt)
        assert (r.pipeline, r.reason, r.estimated_transfer_s) == (
            Pipeline.P_RLD_MD,
            RouteReason.HIT_THRESHOLD,
            None,
        )
    threshold = RoutingConfig(pipeline_policy="threshold")
    fast = LinkState("remote", throughput_bps=1e9)
    r = route(100, stack(fast, md), {"md": 50}, rng, threshold, kv_bytes_per_token=BPT)
    assert (r.pipeline, r.reason) == (Pipeline.P_RLD_MD, RouteReason.HIT_THRESHOLD)


def test_never_behind_an_unhealthy_link_while_a_healthy_one_exists():
    east = inst("md-east", Role.MAIN_DECODE, "east")
    west = inst("md-west", Role.MAIN_DECODE, "west", running=5)
    links = [
        LinkState("east", throughput_bps=1e9, healthy=False),
        LinkState("west", throughput_bps=1e6),
    ]
    instances = [inst("p", Role.PREFILL, links=links), east, west, inst("rld", Role.RELAY)]
    # east holds the whole prompt and is idle; its link is down
    r = route(4096, instances, {"md-east": 4096}, random.Random(0), kv_bytes_per_token=BPT)
    assert r.main_decode.ref.instance_id == "md-west"
    # every link down: still routed (the relay hides what it can), the delta's estimate infinite
    down = [LinkState("east", healthy=False), LinkState("west", healthy=False)]
    instances[0] = inst("p", Role.PREFILL, links=down)
    r = route(4096, instances, {"md-east": 4096}, random.Random(0), kv_bytes_per_token=BPT)
    assert r.main_decode.ref.instance_id == "md-east"
    assert (r.pipeline, r.estimated_transfer_s) == (Pipeline.P_RLD_MD, math.inf)


def test_a_session_sticks_to_the_cluster_holding_its_prefix_while_its_link_is_healthy():
    """Turn after turn a session's prompt grows by 2048 tokens; each turn is decoded where the
    router sends it, so that MainDecode then holds the whole prompt. The first turn is cold."""
    mds = {
        "fast": inst("md-fast", Role.MAIN_DECODE, "fast"),
        "slow": inst("md-slow", Role.MAIN_DECODE, "slow"),
    }
    fast = LinkState("fast", throughput_bps=1e8, rtt_s=0.005)
    slow = LinkState("slow", throughput_bps=2e6, rtt_s=0.08)
    rng = random.Random(0)

    def turns(links, held, first_turn, n):
        chosen = []
        for turn in range(first_turn, first_turn + n):
            instances = [inst("p", Role.PREFILL, links=links), *mds.values(), inst("r", Role.RELAY)]
            r = route(2048 * turn, instances, held, rng, kv_bytes_per_token=BPT)
            chosen.append(r.main_decode.ref.cluster)
            held = {r.main_decode.ref.instance_id: 2048 * turn}
        return chosen, held

    # cold, the fast link wins, and the session stays there
    chosen, _ = turns([fast, slow], {}, 1, 4)
    assert chosen == ["fast"] * 4
    # a session whose prefix sits behind the slow link stays there too: sending its 2048-token
    # delta (1.1 s) costs less than sending its whole prompt anywhere else would save
    chosen, held = turns([fast, slow], {"md-slow": 2048}, 2, 4)
    assert chosen == ["slow"] * 4
    # its link goes bad: the session moves (its prefix stays behind) and sticks to the new one
    chosen, _ = turns([fast, LinkState("slow", 2e6, rtt_s=0.08, healthy=False)], held, 6, 3)
    assert chosen == ["fast"] * 3


def test_a_held_prefix_beats_a_faster_empty_cluster_until_its_link_is_congested():
    holder = inst("md-holder", Role.MAIN_DECODE, "slow")
    empty = inst("md-empty", Role.MAIN_DECODE, "fast")
    cached = {"md-holder": 8192}
    rng = random.Random(0)
    calm = [LinkState("slow", 2e6, rtt_s=0.08), LinkState("fast", 1e8, rtt_s=0.005)]
    instances = [inst("p", Role.PREFILL, links=calm), holder, empty, inst("r", Role.RELAY)]
    assert route(8200, instances, cached, rng, kv_bytes_per_token=BPT).main_decode == holder
    # 100 MB waiting on the slow link: 50 s ahead of the tiny delta
    jam = [LinkState("slow", 2e6, queued_bytes=10**8, rtt_s=0.08), calm[1]]
    instances[0] = inst("p", Role.PREFILL, links=jam)
    assert route(8200, instances, cached, rng, kv_bytes_per_token=BPT).main_decode == empty


def test_links_can_be_passed_instead_of_read_from_prefill():
    md = inst("md", Role.MAIN_DECODE, "remote")
    slow = {"remote": LinkState("remote", throughput_bps=1e3)}
    r = route(1000, stack(None, md), {"md": 0}, random.Random(0), links=slow, kv_bytes_per_token=1)
    assert (r.pipeline, r.reason) == (Pipeline.P_RLD_MD, RouteReason.LINK_BUDGET)


def test_a_full_relay_sends_low_hit_requests_p_md():
    md = inst("md", Role.MAIN_DECODE, "remote")
    cfg = RoutingConfig(relay_max_requests=2, relay_max_kv_usage=0.9)
    rng = random.Random(0)
    busy = inst("rld-busy", Role.RELAY, running=2)
    fat = inst("rld-fat", Role.RELAY, used=95)
    free = inst("rld-free", Role.RELAY, running=1)
    r = route(100, [inst("p", Role.PREFILL), md, busy, fat, free], {}, rng, cfg)
    assert (r.pipeline, r.relay.ref.instance_id) == (Pipeline.P_RLD_MD, "rld-free")
    r = route(100, [inst("p", Role.PREFILL), md, busy, fat], {}, rng, cfg)
    assert (r.pipeline, r.reason, r.relay) == (Pipeline.P_MD, RouteReason.RELAY_FULL, None)
    # the request's own choice still wins over the guard
    r = route(
        100, [inst("p", Role.PREFILL), md, busy], {}, rng, cfg, force_pipeline=Pipeline.P_RLD_MD
    )
    assert (r.pipeline, r.relay.ref.instance_id) == (Pipeline.P_RLD_MD, "rld-busy")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(pipeline_policy="hit_only"), "pipeline_policy"),
        (dict(ttft_budget_s=0.0), "ttft_budget_s"),
        (dict(ttft_budget_ratio=-1.0), "ttft_budget_ratio"),
        (dict(ttft_budget_ratio=math.inf), "ttft_budget_ratio"),
        (dict(relay_max_requests=0), "relay_max_requests"),
        (dict(relay_max_kv_usage=0.0), "relay_max_kv_usage"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**kwargs)
