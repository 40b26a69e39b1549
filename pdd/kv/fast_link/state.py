"""The fast link's transports and the state machine every transfer goes through.

Receiver side (the relay)::

    PENDING ──allocate──▶ REGISTERED ──first TCP chunk──▶ WRITING
       │                     │  (one-sided RDMA / shm writes are invisible: no WRITING)
       │                     └──────────── completion ──────────▶ WRITTEN ──CRC ok──▶ COMPLETED
       │                                                             └──CRC bad──▶ FAILED
       └─ lease runs out before the completion (any non-terminal state) ─▶ EXPIRED

Sender side (prefill): REGISTERED (holds a reservation) → WRITING → WRITTEN
(all bytes written) → COMPLETED (the relay accepted the CRC) or FAILED.

NOTE: terminal states never change again; a transition not in ``_NEXT`` is a
protocol bug and raises ``FailedPreconditionError`` rather than being ignored.
"""

from __future__ import annotations

import enum

from pdd.core.errors import FailedPreconditionError


class Transport(enum.Enum):
    RDMA = "rdma"
    SHM = "shm"
    TCP = "tcp"

    @property
    def trusted(self) -> bool:
        """Whether the bytes' path itself guarantees them: a memcpy within one host's memory,
        or an RDMA reliable connection (its link-level CRC). Their transfers skip the region
        CRC unless both ends ask for it; TCP keeps a CRC per chunk and one over the region."""
        return self is not Transport.TCP


class TransferState(enum.Enum):
    PENDING = "pending"
    REGISTERED = "registered"
    WRITING = "writing"
    WRITTEN = "written"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.COMPLETED, TransferState.FAILED, TransferState.EXPIRED)


_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset(
        {TransferState.REGISTERED, TransferState.FAILED, TransferState.EXPIRED}
    ),
    TransferState.REGISTERED: frozenset(
        {TransferState.WRITING, TransferState.WRITTEN, TransferState.FAILED, TransferState.EXPIRED}
    ),
    TransferState.WRITING: frozenset(
        {TransferState.WRITTEN, TransferState.FAILED, TransferState.EXPIRED}
    ),
    TransferState.WRITTEN: frozenset({TransferState.COMPLETED, TransferState.FAILED}),
    TransferState.COMPLETED: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.EXPIRED: frozenset(),
}


def advance(current: TransferState, new: TransferState, what: str) -> TransferState:
    """``new`` if the machine allows ``current → new``; else ``FailedPreconditionError`` naming ``what``."""
    if new not in _NEXT[current]:
        raise FailedPreconditionError(f"{what}: cannot go from {current.value} to {new.value}")
    return new
