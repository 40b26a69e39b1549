"""``python -m pdd.tools.health_probe ADDR``: one ``grpc.health.v1`` check, as an exit code.

The container health check of every PDD service (docker-compose): exit 0 when ADDR answers
SERVING, 1 when it answers anything else, 2 when the call fails (refused, TLS mismatch,
deadline). TLS settings come from the same flags/env as the services' (``PDD_TLS_*``), so in
a container the probe speaks the service's own TLS, presenting its certificate under mTLS.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdd.server.flags import add_tls_flags, tls_config
from pdd.server.tls import TlsConfig, open_channel


async def check(
    address: str, service: str = "", *, tls: TlsConfig = TlsConfig(), timeout: float = 3.0
) -> int:
    """The ``HealthCheckResponse.ServingStatus`` of ``service`` at ``address`` (raises ``grpc.RpcError``)."""
    async with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (
            await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        ).status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdd.tools.health_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("address", help="host:port")
    parser.add_argument("--service", default="", help="gRPC service name; '' = the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    add_tls_flags(parser)
    args = parser.parse_args(argv)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name
    try:
        status = asyncio.run(
            check(args.address, args.service, tls=tls_config(args), timeout=args.timeout)
        )
    except ValueError as exc:  # a TLS setting that cannot work (missing file, cert without key)
        print(f"{args.address}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    print(f"{args.address}: {name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
