"""Choosing the fast link's transport at start-up, from what the host has.

``probe_host()`` looks for RDMA devices (through ``pyverbs``) and a usable
``/dev/shm``. ``select_transport(preference, same_host)`` then picks:

- ``"auto"``: RDMA if a device exists, else shared memory if prefill and relay
  share the host, else TCP;
- a list such as ``"rdma,tcp"``: the first of them the host can use;
- a single name (``"shm"``): that one, or ``UnavailableError`` — a forced
  transport that cannot work is a configuration error, not a silent fallback.

The choice and the reason are logged once (``fast_link_transport_selected``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from pdd.core.errors import UnavailableError
from pdd.kv.fast_link.rdma import rdma_devices
from pdd.kv.fast_link.state import Transport

log = structlog.get_logger(__name__)
_AUTO = (Transport.RDMA, Transport.SHM, Transport.TCP)


@dataclass(frozen=True)
class HostProbe:
    rdma_devices: tuple[str, ...] = ()
    shm: bool = False


def probe_host() -> HostProbe:
    return HostProbe(rdma_devices(), os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))


def _parse(preference: str | Sequence[str | Transport]) -> tuple[tuple[Transport, ...], bool]:
    """(candidates, forced) from a preference."""
    items = preference.split(",") if isinstance(preference, str) else list(preference)
    names = [i.strip().lower() if isinstance(i, str) else i for i in items]
    if names == ["auto"]:
        return _AUTO, False
    out = []
    for name in names:
        try:
            out.append(name if isinstance(name, Transport) else Transport(name))
        except ValueError:
            raise ValueError(
                f"fast_link_transport: unknown transport {name!r} "
                f"(auto, rdma, shm, tcp or a comma list)"
            ) from None
    if not out:
        raise ValueError("fast_link_transport: empty preference")
    return tuple(out), len(out) == 1


def usable_transports(same_host: bool, probe: HostProbe | None = None) -> tuple[Transport, ...]:
    """What this host can use towards a peer, best first (``PrepareRequest.transports``)."""
    probe = probe or probe_host()
    usable = []
    if probe.rdma_devices:
        usable.append(Transport.RDMA)
    if same_host and probe.shm:
        usable.append(Transport.SHM)
    usable.append(Transport.TCP)
    return tuple(usable)


def usable_candidates(
    preference: str | Sequence[str | Transport], same_host: bool, *, probe: HostProbe | None = None
) -> tuple[Transport, ...]:
    """Every transport of ``preference`` this host can use towards a peer, in preference order."""
    candidates, _ = _parse(preference)
    usable = usable_transports(same_host, probe)
    out = tuple(t for t in candidates if t in usable)
    if not out:
        raise ValueError(
            f"fast_link_transport: none of {[c.value for c in candidates]} is usable here "
            f"(usable: {[t.value for t in usable]})"
        )
    return out


def select_transport(
    preference: str | Sequence[str | Transport] = "auto",
    same_host: bool = False,
    *,
    probe: HostProbe | None = None,
) -> Transport:
    candidates, forced = _parse(preference)
    probe = probe or probe_host()
    usable = usable_transports(same_host, probe)
    for t in candidates:
        if t in usable:
            reason = "forced" if forced else f"first usable of {[c.value for c in candidates]}"
            log.info(
                "fast_link_transport_selected",
                transport=t.value,
                reason=reason,
                same_host=same_host,
                rdma_devices=list(probe.rdma_devices),
                shm=probe.shm,
            )
            return t
    raise UnavailableError(
        f"fast-link transport {[c.value for c in candidates]} not usable here "
        f"(rdma devices: {list(probe.rdma_devices) or 'none'}, same host: {same_host}, "
        f"/dev/shm: {probe.shm})"
    )
