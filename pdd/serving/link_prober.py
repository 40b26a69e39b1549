"""Prefill's RTT probes of its WAN links: one tiny call per remote cluster, every interval.

Life: the first push to a cluster names the MainDecode to probe there (``target``; the last one
pushed to) and starts the loop → every ``interval_s`` each link is probed at once, through the
same path as its KV (``pdd.wire.link_probe``: a gRPC health check) → an answer is the link's
RTT (``LinkMeter.rtt``), none within ``deadline_s`` (or a failed call) marks it unhealthy until
the next answer (``LinkMeter.rtt_timed_out``) → ``close()`` stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog

from pdd.core.errors import PddError
from pdd.kv.link_meter import LinkMeters

log = structlog.get_logger(__name__)


class LinkProbe(Protocol):
    """The RTT probe of a WAN link (``pdd.wire.link_probe.LinkProbeClient``)."""

    async def ping(self, timeout_s: float) -> float: ...


class LinkProber:
    def __init__(
        self,
        links: LinkMeters,
        probe: Callable[[str], LinkProbe],
        *,
        interval_s: float,
        deadline_s: float,
    ) -> None:
        self.links = links
        self._probe = probe
        self.interval_s = interval_s
        self.deadline_s = deadline_s
        # By cluster: the MainDecode address its link's probe goes to.
        self._targets: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    def target(self, cluster: str, address: str) -> None:
        """Probe ``cluster``'s link at ``address`` from now on (call on the event loop)."""
        self._targets[cluster] = address
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            targets = dict(self._targets)
            await asyncio.gather(*(self._once(c, a) for c, a in targets.items()))
            await asyncio.sleep(self.interval_s)

    async def _once(self, cluster: str, address: str) -> None:
        meter = self.links.meter(cluster)
        try:
            ping = self._probe(address).ping(self.deadline_s)
            rtt = await asyncio.wait_for(ping, self.deadline_s)
        except (PddError, TimeoutError) as exc:
            if meter.healthy:  # NOTE: once per outage of the link, not once per probe
                log.warning(
                    "link_probe_failed", cluster=cluster, main_decode=address, error=str(exc)
                )
            meter.rtt_timed_out()
            return
        meter.rtt(rtt)
