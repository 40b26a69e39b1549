"""Where the gateway's peers come from: a typed client per call (``GrpcPeers``, on one long-lived
channel per address), or in tests in-process fakes with the same methods."""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Protocol

from pdd.serving.channels import Channels
from pdd.wire.decode_mux import DecodeMux
from pdd.wire.kvstore_client import KvstoreClient
from pdd.wire.main_decode_client import MainDecodeClient
from pdd.wire.prefill_client import PrefillClient
from pdd.wire.relay_client import RelayClient

# The deadline (``time.monotonic()``) of the request being served, from its client's (gRPC
# deadline): each stage call it opens gets min(its time left, --stage-timeout-s). Set per request by
# ``Gateway.generate``; every request runs in its own task (a copy of the context).
REQUEST_DEADLINE: ContextVar[float | None] = ContextVar("pdd_request_deadline", default=None)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Peers(Protocol):
    """Where the gateway's peers come from: a client per call (``GrpcPeers``; tests: fakes)."""

    def kvstore(self) -> KvstoreClient: ...
    def prefill(self, address: str) -> PrefillClient: ...
    def relay(self, address: str) -> RelayClient: ...
    def main_decode(self, address: str) -> MainDecodeClient: ...
    async def close(self) -> None: ...


class GrpcPeers:
    """The gateway's peers as typed gRPC clients, on one long-lived channel per address."""

    def __init__(
        self,
        channels: Channels,
        kvstore_address: str,
        stage_timeout_s: float,
        index_timeout_s: float = 1.0,
        shared_decode_stream: bool = True,
    ) -> None:
        """``shared_decode_stream``: every request to one MainDecode on one ``DecodeMany``
        stream (``pdd.wire.decode_mux``); False: a ``Decode`` call per request."""
        self.channels = channels
        self.kvstore_address = kvstore_address
        self.stage_timeout_s = stage_timeout_s
        self.index_timeout_s = index_timeout_s
        self.shared_decode_stream = shared_decode_stream
        self._muxes: dict[str, DecodeMux] = {}

    # NOTE: channels are made on first use, inside the server's event loop.
    def kvstore(self) -> KvstoreClient:
        return KvstoreClient(
            self.channels.get(self.kvstore_address), timeout_s=self.index_timeout_s
        )

    def stage_timeout(self) -> float:
        """The deadline of a stage call opened now: ``stage_timeout_s``, or less if the request's
        own deadline comes first (never below 1 ms: a call past it fails DEADLINE_EXCEEDED)."""
        deadline = REQUEST_DEADLINE.get()
        if deadline is None:
            return self.stage_timeout_s
        return max(0.001, min(self.stage_timeout_s, deadline - time.monotonic()))

    def prefill(self, address: str) -> PrefillClient:
        return PrefillClient(self.channels.get(address), timeout_s=self.stage_timeout())

    def relay(self, address: str) -> RelayClient:
        return RelayClient(self.channels.get(address), timeout_s=self.stage_timeout())

    def main_decode(self, address: str) -> MainDecodeClient:
        channel = self.channels.get(address)
        mux = None
        if self.shared_decode_stream:
            mux = self._muxes.get(address)
            if mux is None:
                mux = self._muxes[address] = DecodeMux(channel)
        return MainDecodeClient(channel, timeout_s=self.stage_timeout(), mux=mux)

    async def close(self) -> None:
        muxes, self._muxes = self._muxes, {}
        for mux in muxes.values():
            await mux.close()
        await self.channels.close()
