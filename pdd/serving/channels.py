"""One long-lived gRPC channel per peer address (HTTP/2 multiplexes calls).

Every outgoing channel between services is made here, with the TLS config the service's
``build()`` passes in (its ``ServerConfig.tls``; see ``pdd.server.tls``).
"""

from __future__ import annotations

from pdd.server.tls import Channel, TlsConfig, open_channel

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
]


class Channels:
    def __init__(self, tls: TlsConfig) -> None:
        self._channels: dict[str, Channel] = {}
        # NOTE: no default on purpose: a service that forgot its TLS would dial peers in plaintext.
        self.tls = tls

    def get(self, address: str, lane: str = "") -> Channel:
        """The channel to ``address``; a named ``lane`` gets a TCP connection of its own.

        NOTE: HTTP/2 multiplexes calls on one connection, so a small, urgent KV delta queues
        behind megabytes of bulk KV already in the socket; a separate connection gets its own
        fair share of the (emulated or real) link instead.
        """
        key = f"{address}#{lane}"
        ch = self._channels.get(key)
        if ch is None:
            options = (
                _OPTIONS
                if not lane
                else [*_OPTIONS, ("grpc.use_local_subchannel_pool", 1), ("pdd.lane", lane)]
            )
            ch = self._channels[key] = open_channel(address, self.tls, options)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
