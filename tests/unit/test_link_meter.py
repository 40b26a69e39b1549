"""A WAN link's meter (pdd.kv.link_meter) and the state it publishes (pdd.core.link_state): what
is queued, in flight and sent, throughput over link-busy time only, health, RTT; the state's
validation and its round trip through kvstore's wire messages."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import InstanceLoad
from pdd.core.link_state import LinkState
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.kv.link_meter import LinkMeter, LinkMeterConfig, LinkMeters
from pdd.kv.source import BytesSource
from pdd.wire import kvstore as conv


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class SlowSource:
    """A producer still computing: each read takes ``compute_s`` of the fake clock."""

    def __init__(self, clock: Clock, total: int, compute_s: float) -> None:
        self.clock, self.compute_s = clock, compute_s
        self.inner = BytesSource(bytes(total))

    @property
    def total_bytes(self) -> int:
        return self.inner.total_bytes

    async def read(self, offset: int, length: int) -> memoryview:
        self.clock.t += self.compute_s
        return await self.inner.read(offset, length)


def meter(clock: Clock, **cfg) -> LinkMeter:
    return LinkMeter("remote", LinkMeterConfig(**cfg), clock=clock, wall_ms=lambda: 1234)


def test_queued_until_first_read_then_in_flight_then_gone():
    async def go():
        clock = Clock()
        m = meter(clock)
        with m.push(4000) as a, m.push(1000):
            assert (m.state().queued_bytes, m.state().in_flight_bytes) == (5000, 0)
            src = a.source(BytesSource(bytes(4000)))
            await src.ready(1000)  # computed, no slot yet: still queued, nothing sent
            assert (m.state().queued_bytes, m.state().in_flight_bytes) == (5000, 0)
            await src.read(0, 1000)  # the pusher holds a slot: it reads
            assert (m.state().queued_bytes, m.state().in_flight_bytes) == (1000, 3000)
            await src.read(1000, 3000)
            assert m.state().in_flight_bytes == 0
        assert (m.state().queued_bytes, m.state().in_flight_bytes) == (0, 0)

    asyncio.run(go())


def test_throughput_counts_link_time_not_the_producers():
    async def go():
        clock = Clock()
        m = meter(clock, alpha=1.0, window_s=0.5)
        with m.push(10_000) as p:
            src = p.source(SlowSource(clock, 10_000, compute_s=5.0))  # compute-bound producer
            for off in range(0, 10_000, 1000):
                await src.read(off, 1000)
                clock.t += 0.1  # the wire takes 0.1 s per 1000 bytes: 10 kB/s
        assert m.state().throughput_bps == pytest.approx(10_000, rel=0.01)

    asyncio.run(go())


def test_two_concurrent_pushes_share_the_link():
    async def go():
        clock = Clock()
        m = meter(clock, alpha=0.3, window_s=0.5)
        n = 60_000
        with m.push(n) as a, m.push(n) as b:
            sa, sb = a.source(BytesSource(bytes(n))), b.source(BytesSource(bytes(n)))
            for off in range(0, n, 1000):
                await sa.read(off, 1000)
                await sb.read(off, 1000)
                clock.t += 0.2  # both chunks cross in 0.2 s together: 10 kB/s for the link
        # NOTE: not 5 kB/s (one push's rate): the link's, which the router's estimate divides by.
        assert m.state().throughput_bps == pytest.approx(10_000, rel=0.01)

    asyncio.run(go())


def test_failures_make_the_link_unhealthy_and_a_success_heals_it():
    clock = Clock()
    m = meter(clock, max_failures=2)
    for _ in range(2):
        with pytest.raises(RuntimeError), m.push(10):
            raise RuntimeError("stream broke")
    assert not m.state().healthy
    with m.push(10):
        pass
    assert m.state().healthy
    # a cancelled push (the request went away) is not the link's failure
    for _ in range(3):
        with pytest.raises(asyncio.CancelledError), m.push(10):
            raise asyncio.CancelledError
    assert m.state().healthy and m.failures == 0


def test_rtt_and_its_deadline():
    m = meter(Clock(), rtt_alpha=0.5)
    m.rtt(0.2)
    m.rtt(0.4)
    st = m.state()
    assert st.rtt_s == pytest.approx(0.3) and st.healthy and st.measured_at_ms == 1234
    m.rtt_timed_out()
    assert not m.state().healthy and m.state().rtt_s == pytest.approx(0.3)
    m.rtt(0.1)
    assert m.state().healthy


def test_meters_publish_one_state_per_cluster():
    ms = LinkMeters()
    ms.meter("b").rtt(0.1)
    ms.meter("a")
    assert ms.meter("a") is ms.meter("a")
    assert [s.cluster for s in ms.states()] == ["a", "b"]


def test_transfer_estimate_is_queue_plus_delta_over_throughput_plus_rtt():
    st = LinkState("remote", 1e6, queued_bytes=2_000_000, in_flight_bytes=500_000, rtt_s=0.05)
    assert st.transfer_s(1_500_000) == pytest.approx(4.05)
    with pytest.raises(ValueError, match="throughput_bps"):
        LinkState("remote").transfer_s(1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(cluster=""), "cluster"),
        (dict(throughput_bps=-1.0), "throughput_bps"),
        (dict(throughput_bps=math.inf), "throughput_bps"),
        (dict(queued_bytes=-1), "queued_bytes"),
        (dict(in_flight_bytes=-1), "in_flight_bytes"),
        (dict(rtt_s=math.nan), "rtt_s"),
        (dict(measured_at_ms=-1), "measured_at_ms"),
    ],
)
def test_link_state_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LinkState(**{"cluster": "remote", **kwargs})


def test_links_round_trip_in_the_load_report():
    load = InstanceLoad(
        1,
        0,
        3,
        4,
        (
            LinkState("east", 2.5e9, 10, 20, 0.03, 99, True),
            LinkState("west", 0.0, 0, 0, 0.0, 0, False),
        ),
    )
    msg = pb.InstanceLoad.FromString(conv.load_to_pb(load).SerializeToString())
    assert conv.load_from_pb(msg) == load
    bad = pb.InstanceLoad(links=[pb.LinkState(cluster="x", rtt_s=-1.0)])
    with pytest.raises(InvalidArgumentError) as info:
        conv.load_from_pb(bad)
    assert info.value.field == "load.links[0].rtt_s"


def test_a_state_is_stamped_when_it_is_read():
    # the router drains a report's queue by its age: the stamp is the read, not the last sample
    wall = [1000]
    m = LinkMeter("remote", clock=Clock(), wall_ms=lambda: wall[0])
    assert m.state().measured_at_ms == 0  # nothing measured: no age to drain by
    m.rtt(0.01)
    wall[0] = 5000
    assert m.state().measured_at_ms == 5000
