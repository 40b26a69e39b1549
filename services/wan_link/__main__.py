"""``python -m services.wan_link``: the testbed's WAN between the two clusters.

A userspace link emulator (``pdd.testbed.link_emulator``): everything sent to the
listen address reaches the upstream (a remote-cluster service) through a
shared token bucket with one-way delay and jitter. Prints
``PDD_LISTENING wan_link <host:port>`` once listening; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from pdd.server.flags import LOGGING
from pdd.server.settings import Flag, Settings, parse_config
from pdd.telemetry.logging import configure_logging
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator
from services.wan_link.config import WanLinkConfig

WAN = Settings(
    WanLinkConfig,
    Flag("listen", "host:port to listen on, port 0 = any free port", aliases=("listen",)),
    Flag("upstream", "host:port of the remote service", aliases=("upstream",)),
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
    host, _, port = config.listen.rpartition(":")
    emulator = LinkEmulator(config.link, config.upstream, host=host or "127.0.0.1", port=int(port))
    address = await emulator.start()
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
