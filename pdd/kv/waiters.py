"""Waiting for a transfer by request id, before or after it started.

A consumer (``Decode`` waiting for its KV, ``WaitKvReady``) may ask before the
transfer's first byte — even before its header — arrived, so waits are keyed by
request id rather than held by the transfer. ``resolve`` wakes every current
waiter with the result; ``fail`` with an error. A key nobody waits on holds no
memory.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from pdd.core.errors import DeadlineExceededError

T = TypeVar("T")


class Waiters(Generic[T]):
    def __init__(self, what: str) -> None:
        self._what = what
        self._futures: dict[str, asyncio.Future[T]] = {}
        self._counts: dict[str, int] = {}

    async def wait(self, key: str, timeout_s: float) -> T:
        fut = self._futures.get(key)
        if fut is None:
            fut = self._futures[key] = asyncio.get_running_loop().create_future()
        self._counts[key] = self._counts.get(key, 0) + 1
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{self._what} of {key} not ready after {timeout_s:.3f} s"
            ) from None
        finally:
            left = self._counts.pop(key) - 1
            if left:
                self._counts[key] = left
            elif self._futures.get(key) is fut:
                del self._futures[key]

    def resolve(self, key: str, value: T) -> None:
        fut = self._futures.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def fail(self, key: str, error: BaseException) -> None:
        fut = self._futures.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def __len__(self) -> int:
        return len(self._futures)
