"""Prefill's WAN links per remote cluster: the stream pool is the inter-cluster link's (shared by
every MainDecode of the cluster), the meter sees the real pushes, the probe times the link (or
marks it unhealthy), and the state goes out with the load report and as gauges. A real engine
and the real pusher into a real receiver; no gRPC."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import PrefillJob, TransferDone
from pdd.engine.engine import Engine
from pdd.kv.wan import KvReceiver
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.model_spec import load_model
from pdd.serving.prefill import Prefill, PrefillConfig, PrefillPeers
from tests.unit.test_prefill_life import CONFIG, MODEL, PROMPT, InProcessMainDecode, _Instance


class Probe:
    def __init__(self, rtt_s: float | None) -> None:
        self.rtt_s = rtt_s  # None: never answers
        self.asked: list[str] = []

    def __call__(self, address: str) -> Probe:
        self.asked.append(address)
        return self

    async def ping(self, timeout_s: float) -> float:
        if self.rtt_s is None:
            await asyncio.sleep(3600)
        return self.rtt_s


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


class Node:
    def __init__(self, ckpt, probe: Probe, wan_streams: int = 1) -> None:
        self.engine = Engine(ckpt, CONFIG)
        self.loop = EngineLoop(self.engine)
        self.receiver = KvReceiver()
        self.instance = _Instance(self.engine, self.loop)
        # NOTE: each push holds its slot 200 ms at least: a push behind it in the pool waits
        slow = InProcessMainDecode(self.receiver, latency_s=0.2)
        peers = PrefillPeers(lambda a, lane: slow, None, probe)
        config = PrefillConfig(
            wan_streams=wan_streams,
            wan_chunk_bytes=1024,
            link_probe_interval_s=0.05,
            link_probe_deadline_s=0.2,
        )
        self.prefill = Prefill(self.instance, config=config, peers=peers)

    async def __aenter__(self) -> Node:
        await self.loop.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.prefill.close()
        await self.loop.stop()

    async def done(self, rid: str, md: InstanceRef) -> TransferDone:
        job = PrefillJob(rid, PROMPT, SamplingParams(max_tokens=4), "", Pipeline.P_MD, md, 0)
        events = [ev async for ev in self.prefill.prefill(job)]
        assert isinstance(events[-1], TransferDone)
        return events[-1]


def md(iid: str, cluster: str) -> InstanceRef:
    return InstanceRef(iid, f"{iid}:1", Role.MAIN_DECODE, cluster)


async def test_one_pool_per_cluster_not_per_main_decode(ckpt):
    async with Node(ckpt, Probe(0.01)) as node:
        # two MainDecodes of one cluster, one stream slot on its link: one push waits
        same = await asyncio.gather(
            node.done("a", md("md-a", "east")), node.done("b", md("md-b", "east"))
        )
        assert max(d.wan_queue_ms for d in same) > 100.0
        # two clusters: two links, two pools, nobody waits
        apart = await asyncio.gather(
            node.done("c", md("md-a", "east")), node.done("d", md("md-c", "west"))
        )
        assert max(d.wan_queue_ms for d in apart) < 100.0


async def test_link_state_is_metered_probed_published_and_exported(ckpt):
    probe = Probe(0.012)
    async with Node(ckpt, probe) as node:
        assert node.instance.link_states() == ()  # nothing pushed: no link yet
        await node.done("a", md("md-a", "east"))
        await asyncio.sleep(0.15)  # a probe or two
        (state,) = node.instance.link_states()  # what the heartbeat reports with the load
        assert state.cluster == "east" and state.healthy
        assert state.throughput_bps > 0 and (state.queued_bytes, state.in_flight_bytes) == (0, 0)
        assert state.rtt_s == pytest.approx(0.012) and "md-a:1" in probe.asked
        sample = REGISTRY.get_sample_value
        assert sample("pdd_link_rtt_seconds", {"cluster": "east"}) == pytest.approx(0.012)
        got = sample("pdd_link_throughput_bytes_per_second", {"cluster": "east"})
        assert got == state.throughput_bps


async def test_an_unanswered_probe_marks_the_link_unhealthy(ckpt):
    async with Node(ckpt, Probe(None)) as node:
        await node.done("a", md("md-a", "far"))
        await asyncio.sleep(0.5)  # past the probe's deadline
        (state,) = node.instance.link_states()
        assert state.cluster == "far" and not state.healthy
