"""Group commit: many concurrent writes, one writer connection, one transaction per batch.

Callers queue an operation and await a future. A single writer task, owned by
the store (started when it opens, awaited when it closes), takes everything
queued, runs it as one transaction in one thread hop (:func:`run_batch`), and
each caller's future resolves once the COMMIT that contains its operation has
returned. While a batch is on the writer thread the next one accumulates, so
under load a batch holds roughly everything that arrived during the previous
commit: the per-transaction cost is shared instead of paid per append.

When the database cannot write (see :mod:`.errors`), the whole batch fails
with StoreUnavailable and the writer carries on: the next batch is tried as
usual, so writes resume by themselves once the condition clears. After the
errors that can leave the connection itself unable to write (read-only, I/O),
the store's ``reconnect`` replaces it before the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiosqlite

from torpor._logging import get_logger
from torpor.errors import CorruptStore, StoreError, StoreUnavailable
from torpor.store.commit_queue import CommitQueue, Pending, deliver
from torpor.store.prepare import now_ms
from torpor.store.sqlite.batch import HeadCache, WriteOp, run_batch
from torpor.store.sqlite.errors import RECONNECT, primary_code, store_error
from torpor.store.sqlite.hop import hop

__all__ = ["GroupCommitWriter"]

log = get_logger(__name__)

_Pending = Pending[WriteOp]
Reconnect = Callable[[aiosqlite.Connection], Awaitable[aiosqlite.Connection]]


class GroupCommitWriter:
    """The single writer: a queue of operations and the task that commits them in batches.

    One batch is in flight at a time. Letting the event loop prepare the next
    batch while the thread commits the previous one was measured and lost:
    both sides need the GIL for their Python work, and the thread then waits
    for the loop's switch interval after every SQLite call.
    """

    def __init__(
        self,
        conn: aiosqlite.Connection,
        *,
        reconnect: Reconnect | None = None,
        max_batch: int = 2048,
        cache_size: int = 65536,
    ) -> None:
        self._conn = conn
        self._reconnect = reconnect  # None: keep the connection (an in-memory database)
        self._stale = False  # replace the connection before the next batch
        self._cache = HeadCache(cache_size)
        self._queue: CommitQueue[WriteOp] = CommitQueue(max_batch)
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # committed batches, for stats and tests
        self.largest_batch = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="torpor-writer")

    async def submit(self, op: WriteOp) -> Any:
        """Queue ``op`` and wait for the commit that contains it; its result or its error."""
        running = self._task is not None and not self._task.done()
        return await self._queue.submit(op, running=running)

    async def aclose(self) -> None:
        """Commit what is queued, then stop. If this wait is cancelled, so is the writer."""
        self._queue.close()
        task = self._task
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise

    async def _run(self) -> None:
        try:
            while (batch := await self._queue.next_batch()) is not None:
                # If this task is cancelled mid-commit, the batch still finishes on
                # its thread and ``deliver`` still resolves its callers' futures.
                await self._commit(batch)
        finally:
            self._queue.fail_pending()

    @property
    def connection(self) -> aiosqlite.Connection:
        return self._conn

    async def _commit(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        futures = [future for _, future in batch]

        def deliver(results: list[object]) -> None:  # runs on the writer thread
            loop.call_soon_threadsafe(self._delivered, futures, results)

        ops = [op for op, _ in batch]
        started = time.perf_counter()
        try:
            if self._stale and self._reconnect is not None:
                self._conn = await self._reconnect(self._conn)
                self._stale = False
                log.info("writer_reconnected")
            failures = await hop(self._conn, run_batch, self._cache, ops, now_ms(), deliver)
        except Exception as exc:
            log.error("group_commit_failed", ops=len(ops), error=repr(exc))
            if isinstance(exc, sqlite3.Error) and primary_code(exc) in RECONNECT:
                self._stale = True
            # Callers run_batch has told already are done; anyone else (the reconnect or
            # the hop itself failed) learns it here, so no future is ever left waiting.
            for future in futures:
                if not future.done():
                    future.set_exception(_unavailable(exc))
            return
        # One debug record per batch (free unless enabled): what serve's metrics read.
        log.debug("group_commit", ops=len(ops), failed=failures,
                  seconds=time.perf_counter() - started)


    def _delivered(self, futures: list[asyncio.Future[Any]], results: list[object]) -> None:
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(futures))
        deliver(futures, results)


def _unavailable(exc: Exception) -> StoreError:
    """A fresh error per caller (one exception object must not be raised in many tasks)."""
    if isinstance(exc, sqlite3.Error):
        return store_error(exc, "the writer connection failed")
    error: StoreError
    if isinstance(exc, CorruptStore):
        error = CorruptStore(str(exc))
    elif isinstance(exc, StoreError) and not isinstance(exc, StoreUnavailable):
        error = StoreError(str(exc))
    else:
        error = StoreUnavailable(f"the writer connection failed: {exc}")
    error.__cause__ = exc
    return error
