"""A small async client for the gateway (used by ``pdd generate`` and the tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc
from pdd.server.tls import TlsConfig, open_channel


async def generate_stream(
    address: str,
    prompt: str | list[int],
    *,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout: float | None = None,
    tls: TlsConfig = TlsConfig(),
    **fields,
) -> AsyncIterator[pb.GenerateResponse]:
    """Stream ``GenerateResponse``s; ``prompt`` is text or token ids; extra fields go into the request.

    ``tls``: plaintext by default; ``TlsConfig(ca=...)`` for a TLS gateway (plus cert/key for mTLS).
    """
    request = pb.GenerateRequest(max_tokens=max_tokens, temperature=temperature, **fields)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.token_ids.extend(prompt)
    if seed is not None:
        request.seed = seed
    async with open_channel(address, tls) as channel:
        async for resp in pb_grpc.GatewayServiceStub(channel).Generate(request, timeout=timeout):
            yield resp
