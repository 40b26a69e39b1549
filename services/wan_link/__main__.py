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

from pdd.server.flags import env
from pdd.telemetry.logging import configure_logging
from pdd.testbed.link_emulator import LinkConfig, LinkEmulator


async def serve(config: LinkConfig, listen: str, upstream: str) -> None:
    host, _, port = listen.rpartition(":")
    emulator = LinkEmulator(config, upstream, host=host or "127.0.0.1", port=int(port or 0))
    address = await emulator.start()
    print(f"PDD_LISTENING wan_link {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await emulator.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.wan_link", description=__doc__)
    parser.add_argument("--listen", default=env("PDD_WAN_LISTEN", "127.0.0.1:0"))
    parser.add_argument("--upstream", required=True, help="host:port of the remote service")
    parser.add_argument(
        "--mbps", type=float, default=float(env("PDD_WAN_MBPS", "0")), help="0 = unlimited"
    )
    parser.add_argument("--delay-ms", type=float, default=float(env("PDD_WAN_DELAY_MS", "0")))
    parser.add_argument("--jitter-ms", type=float, default=float(env("PDD_WAN_JITTER_MS", "0")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log-format", choices=("json", "console"), default=env("PDD_LOG_FORMAT", "json")
    )
    args = parser.parse_args(argv)
    configure_logging("wan_link", json=args.log_format == "json")
    config = LinkConfig(
        mbps=args.mbps, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, seed=args.seed
    )
    asyncio.run(serve(config, args.listen, args.upstream))


if __name__ == "__main__":
    main()
