"""Errors the engine raises beyond ``ValueError`` for bad input (services map them to gRPC codes)."""

from __future__ import annotations


class KvCapacityError(Exception):
    """A single request can never fit in the KV pool, however much else is evicted or preempted.

    Raised by ``Engine.add_request`` (and ``append_tokens``) before any state changes; a
    service should answer RESOURCE_EXHAUSTED (or route the request to a bigger instance).
    """

    def __init__(self, request_id: str, blocks_needed: int, num_blocks: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {blocks_needed} KV blocks, but the pool "
            f"only has {num_blocks} in total"
        )
        self.request_id = request_id
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks


class EngineStalledError(RuntimeError):
    """Unfinished, unpaused requests exist but no step can schedule any token.

    Happens only when paused or finished-but-kept requests pin the whole pool.
    """
