"""The router against a slow, obviously-correct reference, plus the threshold rule."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.routing.policy import NoInstanceError, RoutingConfig, route


def inst(iid, role, running=0, used=0, total=100):
    return Instance(
        InstanceRef(iid, "127.0.0.1:1", role), 16, load=InstanceLoad(running, 0, used, total)
    )


def reference_best(cands, cached, cfg, role):
    """Every candidate's score computed longhand; the set of best ones."""
    pool = [c for c in cands if c.ref.role is role]
    roomy = [
        c for c in pool if c.load.kv_blocks_used / c.load.kv_blocks_total <= cfg.max_kv_usage
    ] or pool
    scores = {}
    for c in roomy:
        if role is Role.RELAY:
            scores[c.ref.instance_id] = -(c.load.running_requests + c.load.waiting_requests)
        else:
            scores[c.ref.instance_id] = cached.get(
                c.ref.instance_id, 0
            ) / cfg.tokens_per_load_unit - (c.load.running_requests + c.load.waiting_requests)
    top = max(scores.values())
    return {k for k, v in scores.items() if v == top}


instances_st = st.lists(
    st.tuples(st.sampled_from(list(Role)), st.integers(0, 8), st.integers(0, 100)),
    min_size=1,
    max_size=9,
)


@settings(max_examples=200, deadline=None)
@given(
    specs=instances_st,
    prompt_len=st.integers(1, 4096),
    seed=st.integers(0, 2**32),
    cached_seed=st.integers(0, 2**32),
    local=st.sampled_from([0, 16, 256]),
)
def test_route_matches_reference(specs, prompt_len, seed, cached_seed, local):
    specs = specs + [(Role.PREFILL, 0, 0), (Role.MAIN_DECODE, 0, 0)]
    instances = [
        inst(f"{r.value}-{i}", r, running, used) for i, (r, running, used) in enumerate(specs)
    ]
    crng = random.Random(cached_seed)
    cached = {i.ref.instance_id: crng.randrange(0, prompt_len + 1, 16) for i in instances}
    cfg = RoutingConfig(local_prefill_tokens=local)
    r = route(prompt_len, instances, cached, random.Random(seed), cfg)
    assert r.prefill.ref.instance_id in reference_best(instances, cached, cfg, Role.PREFILL)
    assert r.main_decode.ref.instance_id in reference_best(instances, cached, cfg, Role.MAIN_DECODE)
    hit = min(cached[r.main_decode.ref.instance_id], prompt_len) / prompt_len
    assert r.predicted_hit_rate == pytest.approx(hit)
    has_relay = any(i.ref.role is Role.RELAY for i in instances)
    uncached = prompt_len - min(cached[r.main_decode.ref.instance_id], prompt_len)
    if local and uncached <= local:
        expect = Pipeline.MD
    else:
        expect = Pipeline.P_RLD_MD if has_relay and hit < cfg.hit_threshold else Pipeline.P_MD
    assert r.pipeline is expect
    if expect is Pipeline.P_RLD_MD:
        assert r.relay.ref.instance_id in reference_best(instances, cached, cfg, Role.RELAY)
        busy = r.relay.load.running_requests >= cfg.relay_busy_requests
        assert r.handoff_mode is (HandoffMode.ONE_SHOT if busy else HandoffMode.CATCH_UP)
    else:
        assert r.relay is None and r.handoff_mode is None
    # same seed, same decision
    assert route(prompt_len, instances, cached, random.Random(seed), cfg) == r


def test_threshold_rule_at_the_boundary():
    instances = [inst("p", Role.PREFILL), inst("md", Role.MAIN_DECODE), inst("rld", Role.RELAY)]
    rng = random.Random(0)
    assert route(100, instances, {"md": 95}, rng).pipeline is Pipeline.P_MD
    assert route(100, instances, {"md": 94}, rng).pipeline is Pipeline.P_RLD_MD
    assert (
        route(100, instances, {"md": 0}, rng, RoutingConfig(hit_threshold=0.0)).pipeline
        is Pipeline.P_MD
    )


def test_short_uncached_suffix_is_prefilled_by_main_decode():
    instances = [inst("p", Role.PREFILL), inst("md", Role.MAIN_DECODE), inst("rld", Role.RELAY)]
    cfg = RoutingConfig(local_prefill_tokens=64)
    rng = random.Random(0)
    assert route(1000, instances, {"md": 936}, rng, cfg).pipeline is Pipeline.MD  # 64 uncached
    assert (
        route(1000, instances, {"md": 935}, rng, cfg).pipeline is Pipeline.P_RLD_MD
    )  # 65 uncached, hit 0.935
    assert (
        route(2000, instances, {"md": 1920}, rng, cfg).pipeline is Pipeline.P_MD
    )  # 80 uncached, hit 0.96
    r = route(40, instances, {}, rng, cfg)  # a short cold prompt: no disaggregation at all
    assert (r.pipeline, r.relay, r.handoff_mode) == (Pipeline.MD, None, None)
    assert (
        route(40, instances, {}, rng, cfg, force_pipeline=Pipeline.P_MD).pipeline is Pipeline.P_MD
    )
    assert route(40, instances, {}, rng).pipeline is Pipeline.P_RLD_MD  # off by default
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        RoutingConfig(local_prefill_tokens=-1)


def test_overrides_win():
    instances = [
        inst("p", Role.PREFILL),
        inst("md", Role.MAIN_DECODE),
        inst("rld", Role.RELAY, running=9),
    ]
    r = route(
        100,
        instances,
        {"md": 100},
        random.Random(0),
        force_pipeline=Pipeline.P_RLD_MD,
        force_handoff=HandoffMode.CATCH_UP,
    )
    assert (r.pipeline, r.relay.ref.instance_id, r.handoff_mode) == (
        Pipeline.P_RLD_MD,
        "rld",
        HandoffMode.CATCH_UP,
    )
    r = route(100, instances, {"md": 0}, random.Random(0), force_pipeline=Pipeline.P_MD)
    assert r.pipeline is Pipeline.P_MD and r.relay is None


def test_prefix_affinity_beats_small_load_difference():
    instances = [
        inst("p", Role.PREFILL),
        inst("md-a", Role.MAIN_DECODE, running=1),
        inst("md-b", Role.MAIN_DECODE, running=0),
    ]
    r = route(4096, instances, {"md-a": 4096, "md-b": 0}, random.Random(0))
    assert r.main_decode.ref.instance_id == "md-a" and r.pipeline is Pipeline.P_MD


def test_full_instances_are_avoided_while_others_have_room():
    instances = [
        inst("p", Role.PREFILL),
        inst("md-full", Role.MAIN_DECODE, used=99),
        inst("md-free", Role.MAIN_DECODE, used=10),
    ]
    r = route(64, instances, {"md-full": 64}, random.Random(0))
    assert r.main_decode.ref.instance_id == "md-free"


def test_missing_role_and_bad_input():
    with pytest.raises(NoInstanceError, match="main_decode"):
        route(10, [inst("p", Role.PREFILL)], {}, random.Random(0))
    with pytest.raises(ValueError, match="prompt_len"):
        route(0, [inst("p", Role.PREFILL), inst("md", Role.MAIN_DECODE)], {}, random.Random(0))
    with pytest.raises(ValueError, match="hit_threshold"):
        RoutingConfig(hit_threshold=1.5)
