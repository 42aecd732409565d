"""The group-commit queue both backends share: operations waiting for a commit.

Callers queue an operation and await a future; the backend's writer task(s)
take a batch, commit it in one transaction, and hand each caller its result
or its error. Only *how* a batch is committed differs between SQLite (one
thread hop on the single writer connection) and PostgreSQL (one transaction on
one of the writer connections): that stays in each backend's ``writer``
module. What is here is the part that must behave the same on both: who may
still queue, what a batch holds (at most ``max_batch`` operations, never one
whose caller has given up), how results reach the callers, and that no caller
is ever left waiting once the writer stops.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torpor.errors import StoreError

__all__ = ["CommitQueue", "Failed", "Pending", "deliver"]

Op = TypeVar("Op")
Pending = tuple[Op, "asyncio.Future[Any]"]


@dataclass(frozen=True, slots=True)
class Failed:
    """An operation's exception, carried back to its caller."""

    error: BaseException


class CommitQueue(Generic[Op]):
    """Operations queued for the writer, with the futures their callers await."""

    def __init__(self, max_batch: int) -> None:
        self._max_batch = max_batch
        self._pending: deque[Pending[Op]] = deque()
        self._wake = asyncio.Event()
        self.closing = False

    async def submit(self, op: Op, *, running: bool) -> Any:
        """Queue ``op`` and wait for the commit that contains it; its result or its error.

        ``running`` says whether a writer is still there to take it: without one
        the operation would wait forever, so it is refused at once.
        """
        return await self.put(op, running=running)

    def put(self, op: Op, *, running: bool) -> asyncio.Future[Any]:
        """Queue ``op``; the future of the commit that contains it (:meth:`submit` unawaited).

        A plain function, for a writer whose callers should hold nothing but
        this future while they wait. Cancelling the future before its batch is
        taken withdraws the operation.
        """
        if self.closing or not running:
            raise StoreError("the store is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wake.set()
        return future

    def __len__(self) -> int:
        """How many operations are queued (some of them perhaps withdrawn already)."""
        return len(self._pending)

    def wake(self) -> None:
        """Wake a writer waiting in :meth:`wait` (e.g. once it may take batches again)."""
        self._wake.set()

    async def wait(self) -> None:
        """Until the next :meth:`put`, :meth:`wake` or :meth:`close`.

        For a writer that decides itself when to take a batch (instead of
        :meth:`next_batch`): it checks what it needs, then waits here.
        """
        self._wake.clear()
        await self._wake.wait()

    def close(self) -> None:
        """Take no more operations; the writer drains what is queued and stops."""
        self.closing = True
        self._wake.set()

    async def next_batch(self) -> list[Pending[Op]] | None:
        """The next batch to commit, once there is one; None once closing and drained."""
        while True:
            if not self._pending:
                if self.closing:
                    return None
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.take()
            if batch:
                return batch

    def take(self) -> list[Pending[Op]]:
        """Up to ``max_batch`` queued operations whose callers are still waiting."""
        batch: list[Pending[Op]] = []
        while self._pending and len(batch) < self._max_batch:
            item = self._pending.popleft()
            if not item[1].done():  # a caller cancelled before its turn: never written
                batch.append(item)
        return batch

    def fail_pending(self, error: StoreError | None = None) -> None:
        """Fail every operation still queued: the writer is gone and will not take it."""
        if error is None:
            error = StoreError("the store closed before this write was committed")
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)


def deliver(futures: Sequence[asyncio.Future[Any]], results: Sequence[object]) -> None:
    """Resolve each caller's future with its result, or raise its :class:`Failed` error."""
    for future, result in zip(futures, results, strict=True):
        if future.done():
            continue
        if isinstance(result, Failed):
            future.set_exception(result.error)
        else:
            future.set_result(result)
