"""pdd-client: stream completions from a PDD gateway over gRPC (grpcio + protobuf only)."""

from pdd_client.client import AsyncClient, Client, TlsOptions, generate_request
from pdd_client.gen.common.v1 import common_pb2
from pdd_client.gen.gateway.v1 import gateway_service_pb2

__all__ = [
    "AsyncClient",
    "Client",
    "TlsOptions",
    "common_pb2",
    "gateway_service_pb2",
    "generate_request",
]
__version__ = "0.1.0"
