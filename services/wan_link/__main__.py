"""``python -m services.wan_link``: the testbed's WAN between the main cluster and a remote one.

A userspace link emulator (``pdd.testbed.link_emulator``): everything sent to the
listen address reaches the upstream (a remote-cluster service) through a
shared token bucket with one-way delay and jitter. ``--route LISTEN=UPSTREAM``
(repeatable) adds more listen addresses over the SAME link, e.g. one per
MainDecode of a remote cluster: they share its bandwidth and delay. Prints
``PDD_LISTENING wan_link <host:port>`` (the first route) and a
``PDD_ROUTE <listen> <upstream>`` line per route once listening; with
``--metrics-port`` it serves ``/metrics`` (``pdd.testbed.link_metrics``);
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from prometheus_client import REGISTRY

from pdd.server.flags import LOGGING
from pdd.server.settings import Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from pdd.telemetry.metrics import start_metrics_server
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator, Route
from pdd.testbed.link_metrics import LinkCollector
from services.wan_link.config import WanLinkConfig

WAN = Settings(
    WanLinkConfig,
    Flag("listen", "host:port to listen on, port 0 = any free port", aliases=("listen",)),
    Flag("upstream", "host:port of the remote service", aliases=("upstream",)),
    Flag(
        "routes",
        "LISTEN=UPSTREAM (host:port each), repeatable: more routes over the same link",
        name="wan-route",
        aliases=("route",),
    ),
    Flag(
        "metrics_port", "Prometheus /metrics port (bytes per route), 0 = off", name="metrics-port"
    ),
    prefix="wan",
    title="wan link",
)
LINK = Settings(
    LinkConfig,
    Flag("mbps", "bandwidth of each direction, 0 = unlimited", aliases=("mbps",)),
    Flag("delay_ms", "one-way delay", aliases=("delay-ms",)),
    Flag("jitter_ms", "random extra delay, uniform in [0, jitter]", aliases=("jitter-ms",)),
    Flag("seed", "seed of the jitter", aliases=("seed",)),
    prefix="wan",
    title="wan link",
)


async def serve(config: WanLinkConfig) -> None:
    routes = [
        Route(f"{host or '127.0.0.1'}:{port}", r.upstream)
        for r in config.parsed_routes()
        for host, _, port in [r.listen.rpartition(":")]
    ]
    emulator = LinkEmulator(config.link, routes=routes)
    address = await emulator.start()
    if config.metrics_port:
        REGISTRY.register(LinkCollector(emulator))
        # On the first route's host: 0.0.0.0 in a container, loopback under `pdd up`.
        start_metrics_server(routes[0].listen.rpartition(":")[0], config.metrics_port)
    # NOTE: the routes first: the launcher takes the PDD_LISTENING line as "started".
    for route, listen in zip(emulator.routes, emulator.addresses, strict=True):
        print(f"PDD_ROUTE {listen} {route.upstream}", flush=True)
    print(f"PDD_LISTENING wan_link {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await emulator.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.wan_link", description=__doc__)
    WAN.add(p)
    LINK.add(p)
    LOGGING.add(p)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, cfg = parse_config(p, argv, lambda a: (a, WAN.build(a, link=LINK.build(a))))
    log = LOGGING.values(args)
    configure_logging("wan_link", level=log["log_level"], json=log["log_json"])
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
