"""``python -m services.prefill``: prefill beside the relay; ships KV over both links."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.kv.layout import KvDtype
from pdd.server.bootstrap import run
from pdd.server.flags import add_server_flags, server_config
from pdd.server.settings import KB, Flag, Settings, parse_config
from pdd.serving.prefill import PrefillConfig
from pdd.telemetry.logging import configure_logging
from services.instance_flags import add_instance_flags, instance_config
from services.prefill.config import PrefillServiceConfig

DEFAULT_PORT = 50052

PREFILL = Settings(
    PrefillConfig,
    Flag("wan_streams", "concurrent KV pushes per WAN link"),
    Flag("wan_chunk_bytes", "KV chunk size on the WAN", unit=KB),
    Flag(
        "wan_dtype",
        "KV dtype on the WAN: '' (the engine's), bfloat16, float16, float8_e4m3",
        parse=KvDtype.of,
    ),
    Flag("wan_compression", "compression of each WAN chunk"),
    Flag("fast_link", "auto | comma list of rdma,shm,tcp"),
    Flag(
        "relay_same_host",
        "the relay shares this host (shared-memory transport); off: it is on another host",
        off="relay-remote-host",
    ),
    Flag("link_probe_interval_s", "seconds between two RTT probes of each WAN link"),
    Flag(
        "link_probe_deadline_s",
        "an RTT probe unanswered this long marks its WAN link unhealthy (the router avoids it)",
    ),
    Flag("link_max_failures", "consecutive failed KV pushes after which a WAN link is unhealthy"),
    title="prefill",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    add_server_flags(p, DEFAULT_PORT)
    add_instance_flags(p, Role.PREFILL)
    PREFILL.add(p)
    return p


def config(args: argparse.Namespace) -> PrefillServiceConfig:
    server = server_config(args)
    return PrefillServiceConfig(
        server=server,
        instance=instance_config(args, Role.PREFILL, server.host),
        prefill=PREFILL.build(args),
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(parser(), argv, config)
    configure_logging("prefill", level=cfg.server.log_level, json=cfg.server.log_json)
    from services.prefill.server import build  # NOTE: after logging: loads the fast-link backends

    run(cfg.server, build(cfg))


if __name__ == "__main__":
    main()
