"""What the gateway knows between two heartbeats (``RouteLedger``): its own bytes on each WAN link
and its recent first-token latency, and the gateway feeding both to the link-aware router —
against in-process peers: a delta in flight raises the next request's estimate until prefill
says it crossed, and a measured TTFT replaces the absolute budget."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from pdd.core.instance import InstanceLoad
from pdd.core.link_state import LinkState
from pdd.core.pipeline import Pipeline
from pdd.core.request import FinalEvent, GenerateJob
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import Accepted, Finished, Tokens
from pdd.prefix_index.store import Hit
from pdd.routing.policy import RoutingConfig, route
from pdd.serving.gateway import Gateway
from pdd.serving.route_ledger import RouteLedger
from tests.unit import test_gateway_life as life

BPT = 1000  # KV bytes per token
LINK = LinkState("remote", throughput_bps=1e5, rtt_s=0.001)  # 8 tokens' KV: 80 ms


def test_link_holds_sum_per_cluster_until_released():
    ledger = RouteLedger()
    ledger.hold_link("a", "east", 100)
    ledger.hold_link("b", "east", 50)
    ledger.hold_link("c", "west", 7)
    ledger.hold_link("d", "west", 0)  # nothing to send: nothing held
    assert ledger.pending_bytes() == {"east": 150, "west": 7}
    ledger.release_link("a")
    ledger.release("c")
    ledger.release("never-held")
    assert ledger.pending_bytes() == {"east": 50}


def test_reference_ttft_is_the_recent_median_once_enough_were_seen():
    ledger = RouteLedger(ttft_window=4, ttft_min_samples=3)
    ledger.observe_ttft(0.1)
    ledger.observe_ttft(0.0)  # not a measurement
    ledger.observe_ttft(0.3)
    assert ledger.reference_ttft_s() is None
    ledger.observe_ttft(0.2)
    assert ledger.reference_ttft_s() == pytest.approx(0.2)
    for s in (1.0, 1.0, 1.0):  # the window rolls: the old ones leave
        ledger.observe_ttft(s)
    assert ledger.reference_ttft_s() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ttft_min_samples"):
        RouteLedger(ttft_window=2, ttft_min_samples=3)


def test_hold_enters_the_relay_and_the_delta_the_route_will_send():
    prefill = replace(life.PREFILL, load=InstanceLoad(links=(LINK,)))
    instances = [prefill, life.RELAY, life.MAIN_DECODE]
    ledger = RouteLedger()
    cfg = RoutingConfig(pipeline_policy="threshold")
    rng = random.Random(0)
    plan = route(8, instances, {"m0": 2}, rng, cfg, kv_bytes_per_token=BPT)
    assert plan.pipeline is Pipeline.P_RLD_MD
    ledger.hold("a", plan, 8, BPT)
    assert ledger.pending_bytes() == {"remote": 6 * BPT}
    assert ledger.with_relay_holds(instances)[1].load.running_requests == 1
    local = route(8, instances, {"m0": 8}, rng, replace(cfg, local_prefill_tokens=4))
    assert local.pipeline is Pipeline.MD
    ledger.hold("b", local, 8, BPT)  # MainDecode prefills itself: nothing on the WAN
    ledger.release("a")
    assert ledger.pending_bytes() == {} and ledger.with_relay_holds(instances)[1] == life.RELAY


class LinkPeers:
    """P-MD requests whose prefill holds its TransferDone until ``crossed`` is set; the prefill
    instance reports a measured link with nothing on it."""

    def __init__(self) -> None:
        prefill = replace(life.PREFILL, load=InstanceLoad(links=(LINK,)))
        self.kv = life.FakeKvstore(
            [Hit(i, 0, 0.0) for i in (prefill, life.RELAY, life.MAIN_DECODE)]
        )
        self.crossed = asyncio.Event()
        self.first_sent = asyncio.Event()

    def kvstore(self):
        return self.kv

    def prefill(self, address):
        peers = self

        class Client:
            def prefill(self, job):
                script = [
                    life.first_token(),
                    life.Signal(peers.first_sent),
                    peers.crossed,
                    life.TRANSFER,
                ]
                return life.FakeStream("prefill", script)

            async def bind_main_decode(self, request_id, cached_tokens):
                pass  # the scripted stream does not wait for it

        return Client()

    def main_decode(self, address):
        class Client:
            def decode(self, job):
                script = [Accepted(0), Tokens(1, (21, 22, 23)), Finished("length", 4, 3)]
                return life.FakeStream("main_decode", script)

        return Client()

    async def close(self) -> None:
        pass


async def _generate(gw: Gateway, rid: str, pipeline: Pipeline | None = None) -> FinalEvent:
    job = GenerateJob(rid, life.PROMPT, SamplingParams(max_tokens=4), force_pipeline=pipeline)
    events = [ev async for ev in gw.generate(job)]
    assert isinstance(events[-1], FinalEvent) and events[-1].stats.completion_tokens == 4
    return events[-1]


async def test_a_delta_in_flight_counts_for_the_next_request_until_it_crossed():
    peers = LinkPeers()
    gw = Gateway("unused", RoutingConfig(ttft_budget_s=0.1), peers=peers, kv_bytes_per_token=BPT)
    gw.ledger = RouteLedger(ttft_min_samples=1)
    probe = GenerateJob("probe", life.PROMPT, SamplingParams(max_tokens=4))
    alone = (await gw.choose_route(probe)).estimated_transfer_s
    assert alone == pytest.approx(8 * BPT / 1e5 + 0.001)
    assert gw.ledger.reference_ttft_s() is None
    first = asyncio.create_task(_generate(gw, "a", Pipeline.P_MD))
    await asyncio.wait_for(peers.first_sent.wait(), 5)
    # a's 8 tokens of KV are on the link (prefill reported an empty one): the next waits behind
    assert gw.ledger.pending_bytes() == {"remote": 8 * BPT}
    behind = await gw.choose_route(probe)
    assert behind.estimated_transfer_s == pytest.approx(alone + 8 * BPT / 1e5)
    assert behind.pipeline is Pipeline.P_RLD_MD  # 160 ms > the 100 ms budget
    peers.crossed.set()
    final = await asyncio.wait_for(first, 5)
    assert gw.ledger.pending_bytes() == {}
    # the request's first token (prefill's) is now the reference: the budget is 3 × it
    assert gw.ledger.reference_ttft_s() == pytest.approx(final.stats.ttft_ms / 1000)
    after = await gw.choose_route(probe)
    assert after.budget_s == pytest.approx(3 * final.stats.ttft_ms / 1000)
    await gw.close()
