"""The gateway's answer to a stage refusing a request at its admission (RESOURCE_EXHAUSTED: full,
nothing of the request ran there) and its own bound on requests in flight, against the
in-process fakes of ``test_gateway_life``: a refusal goes to another live instance of the role
(the same pipeline, no migration counted), or, with none left, the client is refused."""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from pdd.core.errors import PeerError, ResourceExhaustedError
from pdd.core.instance import Instance, InstanceRef, Role
from pdd.core.pipeline import Pipeline, Stage
from pdd.core.stage_events import Accepted, Finished, Tokens
from pdd.prefix_index.store import Hit
from pdd.server.tls import TlsConfig
from pdd.serving.channels import Channels
from pdd.serving.gateway import Gateway
from pdd.serving.gateway_peers import REQUEST_DEADLINE, GrpcPeers
from pdd.serving.gateway_recovery import MAIN_DECODE_FULL_WAITS_S
from tests.unit.test_gateway_life import (
    HOLD,
    MAIN_DECODE,
    MAIN_DECODE_1,
    PREFILL,
    TRANSFER,
    FakePeers,
    FakeStream,
    Signal,
    first_token,
    flat,
    job,
    migrations,
    run,
    waits_for_bind,
)

PREFILL_1 = Instance(InstanceRef("p1", "127.0.0.1:7006", Role.PREFILL), 4)


def full(name: str) -> PeerError:
    return PeerError("RESOURCE_EXHAUSTED", f"{name} is full: retry later", name)


class TwoPrefills(FakePeers):
    """``FakePeers`` with a second prefill: the n-th prefill call (whichever instance the router
    or the gateway picks) gets the n-th script of ``prefills``."""

    def __init__(self, *args, prefills: list[list], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv.hits.append(Hit(PREFILL_1, 0, 0.0))
        self.prefill_scripts = list(prefills)
        self.prefill_calls: list[tuple[str, object]] = []  # (address, job)
        self.binds: list[tuple[str, int]] = []  # (address, MainDecode's cached tokens)

    def prefill(self, address: str):
        assert address in (PREFILL.ref.address, PREFILL_1.ref.address)
        peers = self

        class Client:
            def prefill(self, job):
                peers.prefill_calls.append((address, job))
                script = peers.prefill_scripts.pop(0)
                if job.main_decode_cached_tokens is None:
                    peers.bound = asyncio.Event()
                    script = waits_for_bind(script, peers.bound)
                return FakeStream(address, script)

            async def bind_main_decode(self, request_id, cached_tokens):
                peers.binds.append((address, cached_tokens))
                peers.bound.set()

        return Client()


@pytest.mark.parametrize("first_token_before", [False, True], ids=["refused-first", "token-first"])
async def test_a_main_decode_refusing_sends_the_request_to_another_on_the_same_pipeline(
    first_token_before,
):
    """Prefill is opened beside MainDecode, so its first token may come before MainDecode's
    refusal: the request starts over on another MainDecode and the client gets the token once."""
    sent = asyncio.Event()
    peers = FakePeers(
        md=[sent, full("m0")] if first_token_before else [full("m0")],
        prefill=[first_token(), Signal(sent), TRANSFER],
        later={MAIN_DECODE_1: [[Accepted(2), Tokens(1, (21, 22)), Finished("length", 3, 2)]]},
    )
    before = migrations("main_decode_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 2)
    ((address, reopened),) = peers.resumed
    assert address == MAIN_DECODE_1.ref.address
    assert (reopened.pipeline, reopened.resume_token_ids) == (Pipeline.P_MD, ())
    # prefill, opened again beside the new MainDecode, pushes to it from its hit once bound
    first, again = peers.prefill_jobs
    assert first.main_decode == MAIN_DECODE.ref and again.main_decode == MAIN_DECODE_1.ref
    assert again.main_decode_cached_tokens is None and peers.binds == [("req-1", 2)]
    s = final.stats
    assert (s.pipeline, s.main_decode_instance, s.migrations) == (Pipeline.P_MD, "m1", 0)
    assert s.md_cached_tokens == 2
    assert migrations("main_decode_lost") == before  # a refusal is no loss


@pytest.mark.parametrize("others", [False, True], ids=["alone", "all-full"])
async def test_with_every_main_decode_full_the_client_is_refused_before_any_token(others):
    """Prefill's first token arrives before the refusals: it is never streamed (a refusal is
    the client's whole answer), and every call opened for the request is stopped. The last
    MainDecode left is asked again once per wait before the client is refused."""
    sent = asyncio.Event()
    asks = len(MAIN_DECODE_FULL_WAITS_S)
    last = MAIN_DECODE_1 if others else MAIN_DECODE
    later = {last: [[full(last.ref.instance_id)] for _ in range(asks + others)]}
    peers = FakePeers(
        md=[sent, full("m0")], prefill=[first_token(), Signal(sent), HOLD], later=later
    )
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers)
    streamed = []
    with pytest.raises(PeerError) as err:
        async with asyncio.timeout(10):
            async for event in gateway.generate(job(Pipeline.P_MD)):
                streamed.append(event)
    await gateway.close()
    assert err.value.code == "RESOURCE_EXHAUSTED" and streamed == []
    assert peers.prefill_stream.cancelled and not peers.binds
    assert [a for a, _ in peers.resumed] == [last.ref.address] * (asks + others)
    assert len(peers.prefill_jobs) == 1 + others  # asked again beside the same prefill call


async def test_the_only_main_decode_full_is_asked_again_while_prefill_holds_the_request():
    """In a flood prefill and MainDecode may each admit what the other refused: the only
    MainDecode, full, is asked again after a short wait beside the same prefill call, and the
    request is served (no move, nothing streamed before MainDecode accepted)."""
    sent = asyncio.Event()
    peers = FakePeers(
        md=[sent, full("m0")],
        prefill=[first_token(), Signal(sent), TRANSFER],
        later={
            MAIN_DECODE: [
                [full("m0")],
                [Accepted(2), Tokens(1, (21, 22)), Finished("length", 3, 2)],
            ]
        },
    )
    t0 = time.monotonic()
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert time.monotonic() - t0 >= sum(MAIN_DECODE_FULL_WAITS_S[:2])
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 2)
    assert [(a, j.pipeline) for a, j in peers.resumed] == [
        (MAIN_DECODE.ref.address, Pipeline.P_MD)
    ] * 2
    assert len(peers.prefill_jobs) == 1 and peers.binds == [("req-1", 2)]
    s = final.stats
    assert (s.main_decode_instance, s.migrations, s.md_cached_tokens) == ("m0", 0, 2)


async def test_a_prefill_refusal_ends_the_wait_for_a_full_main_decode_at_once():
    """Refused by both stages: the client is refused at once (nothing holds the request, so
    there is nothing to wait for) and the full MainDecode is not asked again."""
    peers = FakePeers(md=[full("m0")], prefill=[full("p0")], later={MAIN_DECODE: [[HOLD]]})
    t0 = time.monotonic()
    with pytest.raises(PeerError) as err:
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert time.monotonic() - t0 < sum(MAIN_DECODE_FULL_WAITS_S)
    await asyncio.sleep(sum(MAIN_DECODE_FULL_WAITS_S[:2]))  # a stray wait would ask by now
    assert not peers.resumed


async def test_a_relay_refusing_falls_back_to_p_md_on_the_same_main_decode():
    peers = FakePeers(
        md=[Accepted(4), HOLD],
        prefill=[first_token(), TRANSFER],
        relay=[full("r0")],
        later={MAIN_DECODE: [[Accepted(3), Tokens(1, (21,)), Finished("length", 2, 1)]]},
    )
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_RLD_MD)), 10)
    assert flat(tokens)[0] == [20, 21]
    assert final.stats.pipeline is Pipeline.P_MD and final.stats.main_decode_instance == "m0"


async def test_a_prefill_refusing_sends_the_request_to_another_prefill():
    peers = TwoPrefills(
        md=[Accepted(0), Tokens(1, (21, 22)), Finished("length", 3, 2)],
        prefills=[[full("prefill")], [first_token(), TRANSFER]],
    )
    before = migrations("prefill_lost")
    tokens, final = await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert flat(tokens) == ([20, 21, 22], [Stage.PREFILL] + [Stage.MAIN_DECODE] * 2)
    (first, first_job), (second, second_job) = peers.prefill_calls
    assert first != second  # another instance, the same job (MainDecode's hit bound to it)
    assert replace(first_job, main_decode_cached_tokens=0) == replace(
        second_job, main_decode_cached_tokens=0
    )
    # MainDecode's hit reached the prefill that computes it: in its job or bound to it
    assert second_job.main_decode_cached_tokens == 0 or peers.binds[-1] == (second, 0)
    # MainDecode, which accepted, kept its call (its tokens above): it waited for the KV
    assert not peers.resumed and final.stats.main_decode_instance == "m0"
    s = final.stats
    assert s.prefill_instance == {PREFILL.ref.address: "p0", PREFILL_1.ref.address: "p1"}[second]
    assert s.migrations == 0 and migrations("prefill_lost") == before


async def test_with_every_prefill_full_the_client_is_refused_and_every_call_stopped():
    peers = TwoPrefills(md=[Accepted(0), HOLD], prefills=[[full("p")], [full("p")]])
    with pytest.raises(PeerError) as err:
        await asyncio.wait_for(run(peers, job(Pipeline.P_MD)), 10)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert len({a for a, _ in peers.prefill_calls}) == 2
    assert peers.md.cancelled and not peers.resumed  # MainDecode frees what it reserved


async def test_the_gateway_refuses_requests_beyond_its_own_bound_at_once():
    peers = FakePeers(md=[Accepted(0), HOLD], prefill=[first_token(), TRANSFER])
    gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers, max_in_flight=1)
    before = REGISTRY.get_sample_value("pdd_admission_refused_total", {"role": "gateway"}) or 0
    held = gateway.generate(job(Pipeline.P_MD))
    assert (await anext(held)).token_ids == (20,)
    with pytest.raises(ResourceExhaustedError, match="gateway is full") as refused:
        await anext(gateway.generate(job(Pipeline.P_MD)))
    # NOTE: the gateway bounds requests, not KV: its message names only what it bounds
    assert str(refused.value).endswith("1 requests admitted (max 1); retry later")
    after = REGISTRY.get_sample_value("pdd_admission_refused_total", {"role": "gateway"})
    assert after == before + 1
    assert gateway.admission.admitted == 1  # the refusal took nothing from the one in flight
    await held.aclose()
    assert gateway.admission.admitted == 0 and peers.md.cancelled
    await gateway.close()


async def test_the_adaptive_bound_admits_up_to_its_limit_and_learns_from_what_happens():
    """With ``adaptive_in_flight`` the bound is the limiter's current limit (read at every
    admission); a first token is a latency sample, a refusal tells the limiter it is overloaded."""
    peers = FakePeers(md=[Accepted(0), HOLD], prefill=[first_token(), TRANSFER])
    gateway = Gateway(
        "127.0.0.1:7000",
        rng=random.Random(7),
        peers=peers,
        max_in_flight=64,
        adaptive_in_flight=True,
    )
    limiter = gateway.limiter
    assert limiter is not None and limiter.limit == 32 and limiter.config.max_limit == 64
    limiter._limit = 1.0  # NOTE: as if it had learned that one request at a time is all
    held = gateway.generate(job(Pipeline.P_MD))
    assert (await anext(held)).token_ids == (20,)
    assert limiter._count == 1  # the first token was sampled, as the round's own
    with pytest.raises(ResourceExhaustedError, match="gateway is full"):
        await anext(gateway.generate(job(Pipeline.P_MD)))
    assert limiter._since_refusal == 0  # the refusal froze the limiter's baseline
    await held.aclose()
    assert gateway.admission.admitted == 0
    await gateway.close()


async def test_a_request_finding_the_bound_reached_waits_for_a_place_then_is_served():
    """``admission_wait_s``: a newcomer at the bound waits for the request in flight to end
    instead of being refused; one that would wait past it is refused, having taken nothing."""
    peers = FakePeers(md=[Accepted(0), HOLD], prefill=[first_token(), TRANSFER])
    gateway = Gateway(
        "127.0.0.1:7000", rng=random.Random(7), peers=peers, max_in_flight=1, admission_wait_s=30
    )
    held = gateway.generate(job(Pipeline.P_MD))
    assert (await anext(held)).token_ids == (20,)
    second = gateway.generate(job(Pipeline.P_MD))
    waiting = asyncio.ensure_future(anext(second))

    async def queued() -> None:
        while gateway.admission.waiting == 0:
            await asyncio.sleep(0)

    await asyncio.wait_for(queued(), 10)  # it reached the line, and stays in it
    assert not waiting.done() and gateway.admission.waiting == 1
    # NOTE: the next request's stage calls come from fresh fakes (each fake serves one request)
    gateway.peers = FakePeers(md=[Accepted(0), HOLD], prefill=[first_token(), TRANSFER])
    await held.aclose()  # its place goes to the waiter, which now runs
    assert (await asyncio.wait_for(waiting, 10)).token_ids == (20,)
    assert gateway.admission.admitted == 1 and gateway.admission.waiting == 0
    # NOTE: the client's deadline caps the wait (half of it: the request needs time to run)
    with pytest.raises(ResourceExhaustedError, match="gateway is full"):
        await anext(gateway.generate(job(Pipeline.P_MD), deadline_s=0.2))
    assert gateway.admission.admitted == 1 and gateway.admission.waiting == 0
    await second.aclose()  # the waiter that got the place gives it back when it ends
    assert gateway.admission.admitted == 0
    with pytest.raises(ValueError, match="^admission_wait_s:"):
        Gateway("127.0.0.1:7000", peers=FakePeers(md=[]), admission_wait_s=-1)
    await gateway.close()


def test_the_gateways_bound_is_positive():
    with pytest.raises(ValueError, match="^max_in_flight:"):
        Gateway("127.0.0.1:7000", peers=FakePeers(md=[]), max_in_flight=0)


# --- the client's deadline bounds every stage call ---------------------------------------------


@pytest.mark.parametrize(
    ("deadline_s", "want"), [(None, 600.0), (5.0, 5.0), (900.0, 600.0), (-1.0, 0.001)]
)
async def test_a_stage_call_gets_the_requests_time_left_within_the_stage_timeout(deadline_s, want):
    channels = Channels(TlsConfig())  # NOTE: nothing connects until a call is made
    peers = GrpcPeers(channels, "127.0.0.1:7000", stage_timeout_s=600.0)

    def timeouts() -> list[float]:
        if deadline_s is not None:
            REQUEST_DEADLINE.set(time.monotonic() + deadline_s)
        return [
            peers.prefill("a").timeout_s,
            peers.relay("a").timeout_s,
            peers.main_decode("a").timeout_s,
        ]

    # NOTE: in a copy of the context, as each request runs in its own task
    got = contextvars.copy_context().run(timeouts)
    assert got == pytest.approx([want] * 3, abs=0.05)
    assert REQUEST_DEADLINE.get() is None
    await channels.close()


async def test_generate_sets_the_requests_deadline_for_its_stage_calls():
    seen: list[float | None] = []

    class Peers(FakePeers):
        def main_decode(self, address: str):
            seen.append(REQUEST_DEADLINE.get())
            return super().main_decode(address)

    peers = Peers(
        md=[Accepted(0), Tokens(1, (21,)), Finished("length", 2, 1)],
        prefill=[first_token(), TRANSFER],
    )

    async def one():
        gateway = Gateway("127.0.0.1:7000", rng=random.Random(7), peers=peers)
        t0 = time.monotonic()
        events = [ev async for ev in gateway.generate(job(Pipeline.P_MD), deadline_s=3.0)]
        await gateway.close()
        return t0, events

    t0, events = await asyncio.create_task(one())
    assert events[-1].finish_reason == "length"
    assert seen and all(d is not None and 3.0 <= d - t0 < 3.1 for d in seen)
