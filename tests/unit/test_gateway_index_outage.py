"""The gateway without its index: kvstore (or its Redis) down, routing goes on from the last known
instances with every predicted hit 0 (``pdd.serving.instance_view``), counted and logged once per
outage; never having seen an instance, it fails UNAVAILABLE as before. In-process fakes, no gRPC.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from pdd.core.errors import PeerError, UnavailableError
from pdd.core.instance import Instance, InstanceLoad, InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.request import FinalEvent, GenerateJob, TokenEvent
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import Accepted, Finished, FirstToken, Tokens, TransferDone
from pdd.prefix_index.store import Hit
from pdd.routing.policy import RoutingConfig
from pdd.serving.gateway import Gateway
from pdd.serving.instance_view import InstanceView

PROMPT = tuple(range(1, 9))
PREFILL = Instance(InstanceRef("p0", "127.0.0.1:7001", Role.PREFILL), 4)
RELAY = Instance(InstanceRef("r0", "127.0.0.1:7002", Role.RELAY), 4)
# m0 is busy but holds the prompt; m1 is idle and holds nothing.
BUSY = Instance(
    InstanceRef("m0", "127.0.0.1:7003", Role.MAIN_DECODE, "remote"), 4, load=InstanceLoad(3)
)
IDLE = Instance(InstanceRef("m1", "127.0.0.1:7004", Role.MAIN_DECODE, "remote"), 4)
# A predicted token outweighs a running request: with hits known, m0 wins; without, m1.
ROUTING = RoutingConfig(tokens_per_load_unit=1)


class FakeIndex:
    """kvstore's client: answers ``hits`` while ``down`` is None, else fails with that code."""

    def __init__(self, hits: list[Hit]) -> None:
        self.hits = hits
        self.down: str | None = None
        self.calls = 0

    def _answer(self) -> None:
        self.calls += 1
        if self.down is not None:
            raise PeerError(self.down, "Redis at 127.0.0.1:6379 unreachable", "kvstore")

    async def list(self, role=None) -> list[Instance]:
        self._answer()
        return [h.instance for h in self.hits]

    async def predict(self, prompt, salt: str = "", *, block_sizes=()) -> list[Hit]:
        self._answer()
        return self.hits


class Script:
    """A stage stream that plays back ``events``, then ends."""

    def __init__(self, events: list) -> None:
        self.events = list(events)

    async def read(self):
        return self.events.pop(0) if self.events else None

    def cancel(self) -> None:
        pass


class FakePeers:
    def __init__(self, hits: list[Hit]) -> None:
        self.index = FakeIndex(hits)
        self.decoded_on: list[str] = []

    def kvstore(self) -> FakeIndex:
        return self.index

    def prefill(self, address: str):
        class Client:
            def prefill(self, job):
                return Script(
                    [FirstToken(20, len(PROMPT), 0, 1.0), TransferDone(0, 64, 0.0, 1.0, 0.0, "")]
                )

            async def bind_main_decode(self, request_id, cached_tokens):
                pass  # the scripted stream does not wait for it

        return Client()

    def main_decode(self, address: str):
        peers = self

        class Client:
            def decode(self, job):
                peers.decoded_on.append(address)
                return Script([Accepted(0), Tokens(1, (21, 22)), Finished("length", 3, 2)])

        return Client()

    def relay(self, address: str):
        raise AssertionError("no relay in these tests")

    async def close(self) -> None:
        pass


def gateway(peers: FakePeers) -> Gateway:
    return Gateway("127.0.0.1:7000", ROUTING, rng=random.Random(7), peers=peers)


def job(request_id: str = "req-1") -> GenerateJob:
    return GenerateJob(request_id, PROMPT, SamplingParams(max_tokens=3))


def fallbacks() -> float:
    return REGISTRY.get_sample_value("pdd_index_fallback_total") or 0.0


def with_relay() -> list[Hit]:
    return [Hit(PREFILL, 0, 0.0), Hit(RELAY, 0, 0.0), Hit(BUSY, 8, 1.0), Hit(IDLE, 0, 0.0)]


async def test_index_down_routes_from_the_last_known_instances_without_hits():
    peers = FakePeers(with_relay())
    gw = gateway(peers)
    try:
        up = await gw.choose_route(job())
        assert up.main_decode == BUSY and up.predicted_md_cached_tokens == 8
        assert up.pipeline is Pipeline.P_MD  # a full hit skips the relay

        before = fallbacks()
        with capture_logs() as logs:
            for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                peers.index.down = code
                down = await gw.choose_route(job())
                # no hit known: load alone picks MainDecode, and a miss goes through the relay
                assert down.main_decode == IDLE and down.predicted_md_cached_tokens == 0
                assert down.predicted_hit_rate == 0.0 and down.pipeline is Pipeline.P_RLD_MD
                assert down.relay == RELAY and down.prefill == PREFILL
            # still ready: the instances it can route to
            assert await gw.instances() == [PREFILL, RELAY, BUSY, IDLE]
            peers.index.down = None
            assert (await gw.choose_route(job())).main_decode == BUSY
        assert fallbacks() - before == 2
        events = [(e["event"], e.get("routed_without_index")) for e in logs]
        # logged once for the outage, and its count when it is over
        assert events == [("routing_without_index", None), ("index_restored", 2)]
    finally:
        await gw.close()


async def test_a_request_is_served_while_the_index_is_down():
    peers = FakePeers([Hit(PREFILL, 0, 0.0), Hit(BUSY, 8, 1.0), Hit(IDLE, 0, 0.0)])
    gw = gateway(peers)
    try:
        await gw.choose_route(job())  # the index answered once
        peers.index.down = "UNAVAILABLE"
        events = [ev async for ev in gw.generate(job("req-2"))]
        *tokens, final = events
        assert isinstance(final, FinalEvent) and final.finish_reason == "length"
        ids = [t for ev in tokens if isinstance(ev, TokenEvent) for t in ev.token_ids]
        assert ids == [20, 21, 22]
        assert final.stats.pipeline is Pipeline.P_MD and final.stats.predicted_hit_rate == 0.0
        assert peers.decoded_on == [IDLE.ref.address]
    finally:
        await gw.close()


async def test_index_down_with_no_instance_ever_seen_fails_unavailable():
    peers = FakePeers(with_relay())
    peers.index.down = "UNAVAILABLE"
    gw = gateway(peers)
    try:
        before = fallbacks()
        with pytest.raises(PeerError) as err:
            await gw.choose_route(job())
        assert err.value.code == "UNAVAILABLE"
        with pytest.raises(PeerError):
            [ev async for ev in gw.generate(job())]
        with pytest.raises(PeerError):
            await gw.instances()
        assert fallbacks() == before
    finally:
        await gw.close()


async def test_an_index_error_that_is_not_an_outage_is_not_routed_around():
    peers = FakePeers(with_relay())
    gw = gateway(peers)
    try:
        await gw.choose_route(job())
        peers.index.down = "INVALID_ARGUMENT"
        with pytest.raises(PeerError) as err:
            await gw.choose_route(job())
        assert err.value.code == "INVALID_ARGUMENT"
    finally:
        await gw.close()


async def test_an_index_emptied_by_a_redis_restart_is_held_then_believed():
    peers = FakePeers(with_relay())
    gw = gateway(peers)
    try:
        await gw.choose_route(job())
        peers.index.hits = []  # Redis came back empty; the instances re-register next heartbeat
        held = await gw.choose_route(job())
        assert held.main_decode == IDLE and held.predicted_md_cached_tokens == 0
        gw.view.hold_s = 0.0  # past the hold: an index with no instance is believed
        with pytest.raises(UnavailableError, match="no live .* instance"):
            await gw.choose_route(job())
    finally:
        await gw.close()


async def test_an_index_lacking_a_role_after_a_redis_restart_keeps_the_last_known_one():
    # NOTE: found by pdd chaos: Redis back empty, MainDecode re-registered first, no prefill yet.
    peers = FakePeers(with_relay())
    gw = gateway(peers)
    try:
        await gw.choose_route(job())
        peers.index.hits = [Hit(BUSY, 8, 1.0), Hit(IDLE, 0, 0.0)]  # no prefill, no relay yet
        partial = await gw.choose_route(job())
        # the roles it names keep their hits; the missing ones come from the view
        assert partial.main_decode == BUSY and partial.predicted_md_cached_tokens == 8
        assert partial.prefill == PREFILL
        assert {i.ref.role for i in await gw.instances()} == set(Role)
        gw.view.hold_s = 0.0  # past the hold: the index is believed
        with pytest.raises(UnavailableError, match="no live prefill instance"):
            await gw.choose_route(job())
    finally:
        await gw.close()


async def test_the_background_refresh_follows_the_index_and_keeps_the_list_through_an_outage():
    index = FakeIndex([Hit(PREFILL, 0, 0.0)])
    view = InstanceView(lambda: index, refresh_s=0.01)
    view.start_refreshing()

    async def until(pred) -> None:
        while not pred():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(until(lambda: view.known == [PREFILL]), 5)
        index.hits = with_relay()
        await asyncio.wait_for(until(lambda: view.known == [PREFILL, RELAY, BUSY, IDLE]), 5)
        index.down = "UNAVAILABLE"
        calls = index.calls
        await asyncio.wait_for(until(lambda: index.calls >= calls + 3), 5)
        assert view.known == [PREFILL, RELAY, BUSY, IDLE]  # kept through the outage
    finally:
        await view.close()
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
