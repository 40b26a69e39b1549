"""The admission rule of an engine role (``pdd.serving.admission``): bounded requests and
reserved KV tokens, refusal at once beyond them, never an eviction, counted and logged once per
burst."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from pdd.core.errors import ResourceExhaustedError
from pdd.serving.admission import Admission, AdmissionConfig, Limits


def refused(role: str) -> float:
    return REGISTRY.get_sample_value("pdd_admission_refused_total", {"role": role}) or 0.0


def admission(requests: int, tokens: int, role: str = "test_role") -> Admission:
    return Admission(role, lambda: Limits(requests, tokens))


def test_requests_beyond_the_bound_are_refused_until_one_ends():
    adm = admission(2, 10_000)
    a, b = adm.admit("a", 10), adm.admit("b", 10)
    before = refused("test_role")
    with pytest.raises(ResourceExhaustedError, match=r"test_role is full: 2 requests admitted"):
        adm.admit("c", 10)
    assert refused("test_role") == before + 1
    # NOTE: the refusal took nothing from the admitted ones
    assert (adm.admitted, adm.reserved_tokens) == (2, 20)
    a.release()
    c = adm.admit("c", 10)
    assert (adm.admitted, adm.reserved_tokens) == (2, 20)
    b.release()
    c.release()
    assert (adm.admitted, adm.reserved_tokens) == (0, 0)


def test_reserved_tokens_beyond_the_bound_are_refused():
    adm = admission(10, 100)
    big = adm.admit("a", 60)
    adm.admit("b", 40)  # exactly at the bound: admitted
    with pytest.raises(ResourceExhaustedError, match=r"100 \+ 1 KV tokens reserved \(max 100\)"):
        adm.admit("c", 1)
    big.release()
    adm.admit("c", 60)
    assert adm.reserved_tokens == 100


def test_a_request_larger_than_the_token_bound_is_admitted_only_on_an_idle_stage():
    adm = admission(10, 100)
    alone = adm.admit("huge", 500)  # the engine's own capacity check judges it
    with pytest.raises(ResourceExhaustedError):
        adm.admit("small", 1)
    alone.release()
    adm.admit("small", 1)
    with pytest.raises(ResourceExhaustedError):
        adm.admit("huge", 500)


def test_release_is_idempotent():
    adm = admission(1, 100)
    ticket = adm.admit("a", 30)
    ticket.release()
    ticket.release()
    assert (adm.admitted, adm.reserved_tokens) == (0, 0)
    adm.admit("b", 30)
    assert adm.admitted == 1


def test_negative_tokens_are_a_bug():
    with pytest.raises(ValueError, match="tokens"):
        admission(1, 1).admit("a", -1)


def test_a_refusal_burst_is_logged_once_and_counted_per_request():
    adm = admission(1, 100, role="burst_role")
    held = adm.admit("a", 1)
    before = refused("burst_role")
    with capture_logs() as logs:
        for i in range(5):
            with pytest.raises(ResourceExhaustedError):
                adm.admit(f"r{i}", 1)
        held.release()
        held = adm.admit("b", 1)  # an admission ends the burst
        with pytest.raises(ResourceExhaustedError):
            adm.admit("r5", 1)
    bursts = [e for e in logs if e["event"] == "admission_refusing"]
    assert [e["request_id"] for e in bursts] == ["r0", "r5"]
    assert bursts[0]["role"] == "burst_role" and bursts[0]["max_admitted"] == 1
    assert refused("burst_role") == before + 6


def test_unset_bounds_derive_from_the_engines_kv_pool_once_it_is_known():
    class Batch:
        max_num_seqs = 3

    class Pool:
        num_blocks, block_size, config = 16, 4, Batch()

    engines = []

    def engine() -> Pool:
        engines.append(1)
        return Pool()

    adm = Admission.for_engine("derived", AdmissionConfig(), engine)
    assert not engines  # NOTE: the role is built before its engine
    assert adm.limits == Limits(3, 64)  # a full running batch; the whole KV pool
    adm.admit("a", 1)
    assert len(engines) == 1
    assert Admission.for_engine("set", AdmissionConfig(5, 7), engine).limits == Limits(5, 7)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_admitted": -1}, "max_admitted"),
        ({"max_admitted_tokens": -1}, "max_admitted_tokens"),
    ],
)
def test_config_rejects_negative_bounds(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AdmissionConfig(**kwargs)


@pytest.mark.parametrize(("requests", "tokens", "field"), [(0, 1, "requests"), (1, 0, "tokens")])
def test_limits_are_positive(requests, tokens, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        Limits(requests, tokens)
