"""``python -m services.prefill``: prefill beside the relay; ships KV over both links."""

from __future__ import annotations

import argparse

from pdd.core.instance import Role
from pdd.server.bootstrap import run
from pdd.server.flags import (
    add_engine_flags,
    add_instance_flags,
    add_server_flags,
    env,
    instance_config,
    server_config,
)
from pdd.telemetry.logging import configure_logging

DEFAULT_PORT = 50052


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    add_instance_flags(parser, "prefill")
    add_engine_flags(parser)
    parser.add_argument(
        "--wan-streams",
        type=int,
        default=int(env("PDD_WAN_STREAMS", "4")),
        help="concurrent KV pushes per WAN link (env PDD_WAN_STREAMS)",
    )
    parser.add_argument("--wan-chunk-kb", type=int, default=int(env("PDD_WAN_CHUNK_KB", "1024")))
    parser.add_argument(
        "--wan-dtype",
        default=env("PDD_WAN_DTYPE", ""),
        help="KV dtype on the WAN: '' (the engine's), bfloat16, float16, float8_e4m3",
    )
    parser.add_argument(
        "--wan-compression", choices=("none", "zlib"), default=env("PDD_WAN_COMPRESSION", "none")
    )
    parser.add_argument(
        "--fast-link",
        default=env("PDD_FAST_LINK", "auto"),
        help="auto | comma list of rdma,shm,tcp (env PDD_FAST_LINK)",
    )
    parser.add_argument(
        "--relay-remote-host",
        action="store_true",
        help="the relay is on another host: no shared-memory transport",
    )
    args = parser.parse_args(argv)
    server = server_config(args)
    configure_logging("prefill", level=server.log_level, json=server.log_json)
    from pdd.kv.layout import KvDtype  # NOTE: after logging: imports torch
    from pdd.kv.transfer import Compression
    from pdd.serving.prefill import PrefillConfig
    from services.prefill.config import PrefillServiceConfig
    from services.prefill.server import build

    prefill = PrefillConfig(
        wan_streams=args.wan_streams,
        wan_chunk_bytes=args.wan_chunk_kb * 1024,
        wan_dtype=KvDtype.of(args.wan_dtype) if args.wan_dtype else None,
        wan_compression=Compression(args.wan_compression),
        fast_link=args.fast_link,
        relay_same_host=not args.relay_remote_host,
    )
    config = PrefillServiceConfig(
        server=server, instance=instance_config(args, Role.PREFILL), prefill=prefill
    )
    run(config.server, build(config))


if __name__ == "__main__":
    main()
