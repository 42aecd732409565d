"""The lock that orders one agent's appends: taken without a coroutine when it is free.

``asyncio.Lock.acquire`` is a coroutine: every append paid for one, though the
lock is almost always free (it only orders the actor's writes with a message
logged by a sender's task mid-turn). This one is taken by a plain call when
free, and handed from holder to waiter in arrival order otherwise. It is also
smaller: one per live agent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType

__all__ = ["WriteLock"]


class WriteLock:
    """A FIFO asyncio lock: :meth:`try_acquire` first, :meth:`acquire` only if it fails."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: deque[asyncio.Future[None]] | None = None

    def locked(self) -> bool:
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock if it is free and nobody waits for it; True if taken."""
        if self._held or self._waiters:
            return False
        self._held = True
        return True

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        if self._waiters is None:
            self._waiters = deque()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # resolved by release(), which hands the lock over as it is
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over, then cancelled: pass it on
            raise
        finally:
            waiters = self._waiters
            if waiters is not None:
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    self._waiters = None

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("WriteLock released while not held")
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # still held: it is the waiter's now
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
