"""Configuration of the WAN emulator service."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.testbed.link_emulator import LinkConfig, Route


@dataclass(frozen=True)
class WanLinkConfig:
    # host:port of the remote-cluster service everything is forwarded to ("" with routes only).
    upstream: str = ""
    # host:port to listen on for ``upstream``; port 0 picks a free one (printed at start-up).
    listen: str = "127.0.0.1:0"
    # More LISTEN=UPSTREAM routes (host:port each) over the SAME link: one remote cluster's
    # MainDecodes share its bandwidth and delay, as they share prefill's stream pool to it.
    routes: tuple[str, ...] = ()
    # Prometheus /metrics (the link's bytes per route and direction); 0 = off.
    metrics_port: int = 0
    link: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        if not self.upstream and not self.routes:
            raise ValueError("upstream: expected host:port (or at least one --route)")
        names = ("upstream", "listen") if self.upstream else ("listen",)
        for name in names:
            host, sep, port = getattr(self, name).rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"{name}: expected host:port, got {getattr(self, name)!r}")
        self.parsed_routes()  # a malformed route is refused here
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in 0..65535, got {self.metrics_port}")

    def parsed_routes(self) -> list[Route]:
        """Every route of the link: ``listen=upstream`` first (when set), then ``routes``."""
        first = [Route(self.listen, self.upstream)] if self.upstream else []
        return first + [Route.parse(r) for r in self.routes]
