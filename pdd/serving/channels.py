"""One long-lived gRPC channel per peer address (HTTP/2 multiplexes calls).

Every outgoing channel between services is made here (TLS per ``pdd.server.tls``).
"""

from __future__ import annotations

import grpc

from pdd.server.tls import TlsConfig, installed, open_channel

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
]


class Channels:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        # NOTE: default: the process's TLS settings, installed from the service's flags.
        self.tls = installed() if tls is None else tls

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.tls, _OPTIONS)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
