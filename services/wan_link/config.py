"""Configuration of the WAN emulator service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.testbed.link_emulator import LinkConfig


@dataclass(frozen=True)
class WanLinkConfig:
    # host:port of the remote-cluster service everything is forwarded to.
    upstream: str
    # host:port to listen on; port 0 picks a free one (printed at start-up).
    listen: str = "127.0.0.1:0"
    link: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        for name in ("upstream", "listen"):
            host, sep, port = getattr(self, name).rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"{name}: expected host:port, got {getattr(self, name)!r}")
