"""The gateway client: one channel, ``generate`` as a stream of ``GenerateResponse``s.

A request's life from here: ``generate_request`` builds the ``GenerateRequest`` (text or token
ids, sampling, routing overrides) → ``GatewayService/Generate`` streams token deltas, each with
its ``start_position`` and the stage that produced it (prefill, relay, main_decode) → the last
message carries ``finish_reason`` and ``stats``. Errors arrive as ``grpc.RpcError`` with the
gateway's status code (``INVALID_ARGUMENT`` names the field).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdd_client.gen.gateway.v1 import gateway_service_pb2 as pb
from pdd_client.gen.gateway.v1 import gateway_service_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class TlsOptions:
    """TLS towards the gateway: ``ca`` to verify it (else the system roots), cert + key for mTLS."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    # Verify this name instead of the dialled host (grpc.ssl_target_name_override).
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("cert and key go together (got only one of them)")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def generate_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    **fields,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``: ``prompt`` is text or token ids; extra fields go in as they are."""
    request = pb.GenerateRequest(max_tokens=max_tokens, temperature=temperature, **fields)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.token_ids.extend(prompt)
    if seed is not None:
        request.seed = seed
    return request


class Client:
    """Blocking client; use as a context manager or call ``close()``."""

    def __init__(self, address: str, *, tls: TlsOptions | None = None) -> None:
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=tls.options())
        self._stub = pb_grpc.GatewayServiceStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **fields
    ) -> Iterator[pb.GenerateResponse]:
        yield from self._stub.Generate(generate_request(prompt, **fields), timeout=timeout)

    def model_info(self, *, timeout: float | None = 10.0) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same over ``grpc.aio``; create it inside the event loop that uses it."""

    def __init__(self, address: str, *, tls: TlsOptions | None = None) -> None:
        if tls is None:
            self._channel = grpc.aio.insecure_channel(address)
        else:
            self._channel = grpc.aio.secure_channel(
                address, tls.credentials(), options=tls.options()
            )
        self._stub = pb_grpc.GatewayServiceStub(self._channel)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **fields
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for resp in self._stub.Generate(generate_request(prompt, **fields), timeout=timeout):
            yield resp

    async def model_info(self, *, timeout: float | None = 10.0) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
