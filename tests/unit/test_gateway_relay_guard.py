"""The guarded relay in the gateway, against in-process peers: a burst of low-hit requests routed
between two relay heartbeats (the relay's reported load stays 0) must not overrun
``relay_max_requests`` — the gateway counts what it sent the relay itself — and the requests kept
off go P-MD, counted in ``pdd_router_relay_full_total``; once the relay's requests left it, it
takes requests again."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import REGISTRY

from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.request import FinalEvent, GenerateJob
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import Accepted, Finished, HandedOff, Tokens
from pdd.prefix_index.store import Hit
from pdd.routing.policy import RoutingConfig
from pdd.serving.gateway import Gateway
from tests.unit.test_gateway_life import (
    MAIN_DECODE,
    PREFILL,
    PROMPT,
    RELAY,
    TRANSFER,
    FakeKvstore,
    FakeStream,
    Signal,
    first_token,
)

CAP = 2


class CountedStream(FakeStream):
    """A relay stream that counts how many are open at once."""

    def __init__(self, peers: BurstPeers, script: list) -> None:
        super().__init__("relay", script)
        self.peers = peers
        peers.relay_open += 1
        peers.relay_peak = max(peers.relay_peak, peers.relay_open)
        self.open = True

    async def read(self):
        ev = await super().read()
        if ev is None and self.open:
            self.open = False
            self.peers.relay_open -= 1
        return ev


class BurstPeers:
    """Every request's stages: P-MD or P-RLD-MD, as the gateway routed it. A relay request waits
    on ``release`` before it hands off."""

    def __init__(self) -> None:
        # NOTE: every hit 0 and the relay reports no load: under θ each request wants the relay.
        self.kv = FakeKvstore([Hit(i, 0, 0.0) for i in (PREFILL, RELAY, MAIN_DECODE)])
        self.release = asyncio.Event()
        self.relay_open = self.relay_peak = 0
        self.handed: dict[str, asyncio.Event] = {}
        self.pipelines: dict[str, Pipeline] = {}

    def kvstore(self):
        return self.kv

    def prefill(self, address):
        class Client:
            def prefill(self, job):
                return FakeStream("prefill", [first_token(), TRANSFER])

            async def bind_main_decode(self, request_id, cached_tokens):
                pass  # the scripted stream does not wait for it

        return Client()

    def relay(self, address):
        peers = self

        class Client:
            def decode(self, job):
                handed = peers.handed.setdefault(job.request_id, asyncio.Event())
                script = [
                    Accepted(),
                    peers.release,
                    Tokens(1, (21,)),
                    HandedOff(2, HandoffMode.ONE_SHOT, 1, 1.0),
                    Signal(handed),
                ]
                return CountedStream(peers, script)

        return Client()

    def main_decode(self, address):
        peers = self

        class Client:
            def decode(self, job):
                peers.pipelines[job.request_id] = job.pipeline
                if job.pipeline is Pipeline.P_RLD_MD:
                    handed = peers.handed.setdefault(job.request_id, asyncio.Event())
                    script = [Accepted(0), handed, Tokens(2, (22, 23)), Finished("length", 4, 2)]
                else:
                    script = [Accepted(0), Tokens(1, (21, 22, 23)), Finished("length", 4, 3)]
                return FakeStream("main_decode", script)

        return Client()

    async def close(self) -> None:
        pass


def relay_full() -> float:
    return REGISTRY.get_sample_value("pdd_router_relay_full_total") or 0.0


async def _generate(gw: Gateway, rid: str) -> FinalEvent:
    events = [
        ev async for ev in gw.generate(GenerateJob(rid, PROMPT, SamplingParams(max_tokens=4)))
    ]
    assert isinstance(events[-1], FinalEvent) and events[-1].stats.completion_tokens == 4
    return events[-1]


async def test_a_burst_never_overruns_the_relay_and_the_rest_goes_p_md():
    peers = BurstPeers()
    config = RoutingConfig(pipeline_policy="threshold", relay_max_requests=CAP)
    gw = Gateway("127.0.0.1:7000", config, random.Random(0), peers=peers)
    before = relay_full()
    burst = [asyncio.create_task(_generate(gw, f"b{i}")) for i in range(8)]
    while len(peers.pipelines) < 8:
        await asyncio.sleep(0.01)
    routed = list(peers.pipelines.values())
    assert routed.count(Pipeline.P_RLD_MD) == CAP and routed.count(Pipeline.P_MD) == 8 - CAP
    assert relay_full() - before == 8 - CAP
    peers.release.set()
    finals = await asyncio.wait_for(asyncio.gather(*burst), 10)
    assert sum(f.stats.rld_tokens for f in finals) == CAP  # one relay token per relay request
    assert peers.relay_peak == CAP
    # the relay's requests left it: the next one goes through it again
    final = await asyncio.wait_for(_generate(gw, "after"), 10)
    assert final.stats.pipeline is Pipeline.P_RLD_MD and relay_full() - before == 8 - CAP
    await gw.close()
