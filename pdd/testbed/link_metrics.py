"""The WAN emulator's Prometheus series, read from its counters at scrape time.

``pdd_wan_link_bytes_total{route, direction}``: bytes the link delivered per route (its upstream,
host:port) and direction (``up``: towards the upstream, ``down``: back);
``pdd_wan_link_connections{route}``: connections open now. One wan_link process is one link, so
its routes' bytes together are what the link's bandwidth was shared by.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdd.testbed.link_emulator import LinkEmulator


class LinkCollector(Collector):
    def __init__(self, emulator: LinkEmulator) -> None:
        self._emulator = emulator

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        # NOTE: called from the metrics server's thread; it only reads ints the loop writes.
        sent = CounterMetricFamily(
            "pdd_wan_link_bytes",
            "Bytes the emulated WAN link delivered, by route (its upstream) and direction",
            labels=["route", "direction"],
        )
        open_now = GaugeMetricFamily(
            "pdd_wan_link_connections", "Connections open through the link", labels=["route"]
        )
        for route, stats in self._emulator.route_stats().items():
            sent.add_metric([route, "up"], stats.bytes_up)
            sent.add_metric([route, "down"], stats.bytes_down)
            open_now.add_metric([route], stats.connections_active)
        yield sent
        yield open_now
