"""The admission rule of an engine role (``pdd.serving.admission``): bounded requests and
reserved KV tokens, refusal at once beyond them, never an eviction, counted and logged once per
burst."""

from __future__ import annotations

import asyncio

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


# --- the gateway's short wait for a place (admit_within) -------------------------------------


async def test_a_waiter_gets_the_first_freed_place_in_arrival_order():
    adm = admission(2, 10_000, role="test_wait")
    held, other = adm.admit("a", 0), adm.admit("a2", 0)
    first = asyncio.create_task(adm.admit_within("b", 0, wait_s=5.0))
    second = asyncio.create_task(adm.admit_within("c", 0, wait_s=5.0))
    await asyncio.sleep(0)
    assert adm.waiting == 2 and not first.done()
    # NOTE: a newcomer does not overtake the queue, even at the instant a place frees
    held.release()
    b = await first
    assert adm.admitted == 2 and adm.waiting == 1 and not second.done()
    b.release()
    c = await second
    assert (adm.admitted, adm.waiting) == (2, 0)
    c.release()
    other.release()
    assert adm.admitted == 0


async def test_a_waiter_is_refused_after_its_wait_and_counted_once():
    adm = admission(1, 10_000, role="test_wait_refused")
    adm.admit("a", 0)
    before = refused("test_wait_refused")
    with pytest.raises(ResourceExhaustedError, match="test_wait_refused is full"):
        await adm.admit_within("b", 0, wait_s=0.05)
    assert refused("test_wait_refused") == before + 1
    assert (adm.admitted, adm.waiting) == (1, 0)


async def test_the_queue_holds_at_most_as_many_as_the_bound_then_refuses_at_once():
    adm = admission(2, 10_000, role="test_wait_full")
    adm.admit("a", 0), adm.admit("b", 0)
    waiters = [asyncio.create_task(adm.admit_within(f"w{i}", 0, wait_s=5.0)) for i in range(2)]
    await asyncio.sleep(0)
    assert adm.waiting == 2
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ResourceExhaustedError):
        await adm.admit_within("late", 0, wait_s=5.0)
    assert loop.time() - t0 < 1.0  # refused without waiting (margin for a loaded machine)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert (adm.admitted, adm.waiting) == (2, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_nothing():
    adm = admission(2, 10_000, role="test_wait_cancel")
    held, other = adm.admit("a", 0), adm.admit("a2", 0)
    gone = asyncio.create_task(adm.admit_within("gone", 0, wait_s=5.0))
    stays = asyncio.create_task(adm.admit_within("stays", 0, wait_s=5.0))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.waiting == 1
    held.release()
    ticket = await stays
    assert adm.admitted == 2
    ticket.release()
    other.release()
    assert adm.admitted == 0


async def test_a_place_granted_to_a_waiter_cancelled_in_the_same_instant_is_given_back():
    adm = admission(1, 10_000, role="test_wait_race")
    held = adm.admit("a", 0)
    waiter = asyncio.create_task(adm.admit_within("w", 0, wait_s=5.0))
    await asyncio.sleep(0)
    held.release()  # the place goes to the waiter's future ...
    waiter.cancel()  # ... and the waiter is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (adm.admitted, adm.waiting) == (0, 0)
    adm.admit("next", 0)


async def test_a_grown_adaptive_bound_admits_waiters_on_the_next_arrival():
    bound = {"requests": 1}
    adm = Admission("test_wait_grow", lambda: Limits(bound["requests"], 10_000), fixed=False)
    adm.admit("a", 0)
    waiter = asyncio.create_task(adm.admit_within("w", 0, wait_s=5.0))
    await asyncio.sleep(0)
    bound["requests"] = 3
    newcomer = await adm.admit_within("n", 0, wait_s=5.0)
    assert adm.admitted == 3 and adm.waiting == 0
    newcomer.release()
    (await waiter).release()
    assert adm.admitted == 1


async def test_a_newcomer_the_recent_release_rate_would_not_reach_in_time_is_refused_at_once(
    monkeypatch,
):
    """Places freed at 10/s lately: a newcomer's turn comes 0.1 s per place ahead of it, so with a
    0.25 s wait the first two in line wait and the third is refused at once (a fake clock)."""
    now = 1000.0
    monkeypatch.setattr("pdd.serving.admission._now", lambda: now)
    adm = admission(8, 10_000, role="test_wait_rate")
    adm._released_at.extend(now - 0.5 + 0.1 * k for k in range(5))  # 5 in the last 0.5 s
    held = [adm.admit(f"r{i}", 0) for i in range(8)]
    assert adm._expected_wait_s(0) == pytest.approx(0.1)
    assert adm._expected_wait_s(2) == pytest.approx(0.3)
    line = [asyncio.create_task(adm.admit_within(f"w{i}", 0, wait_s=0.25)) for i in range(3)]
    await asyncio.sleep(0)
    assert adm.waiting == 2 and not line[0].done() and not line[1].done()
    with pytest.raises(ResourceExhaustedError, match="test_wait_rate is full"):
        line[2].result()
    held[0].release()  # the head of the line gets the place
    (await line[0]).release()
    line[1].cancel()
    await asyncio.gather(line[1], return_exceptions=True)
    assert adm.waiting == 0 and adm.admitted == 7


async def test_after_a_waiter_ran_out_of_time_newcomers_are_refused_at_once_for_a_while(
    monkeypatch,
):
    """A waiter timing out says the line is not moving (overload, not a peak): for 4 of its
    waits nobody queues, then waiting is allowed again (a fake clock)."""
    clock = {"now": 1000.0}
    monkeypatch.setattr("pdd.serving.admission._now", lambda: clock["now"])
    adm = admission(1, 10_000, role="test_wait_dry")
    held = adm.admit("a", 0)
    with pytest.raises(ResourceExhaustedError):
        await adm.admit_within("w", 0, wait_s=0.01)  # runs out of time
    clock["now"] += 0.03  # within 4 x 0.01 s of the time-out
    newcomer = asyncio.create_task(adm.admit_within("n", 0, wait_s=0.01))
    await asyncio.sleep(0)
    assert newcomer.done() and adm.waiting == 0  # refused without joining the line
    with pytest.raises(ResourceExhaustedError):
        newcomer.result()
    clock["now"] += 0.02  # the dry spell is over: a newcomer may wait again
    later = asyncio.create_task(adm.admit_within("l", 0, wait_s=0.01))
    await asyncio.sleep(0)
    assert adm.waiting == 1
    held.release()
    (await later).release()
    assert adm.admitted == 0
