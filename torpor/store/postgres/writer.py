"""Group commit on PostgreSQL: many concurrent writes, few transactions.

Callers queue an operation and await a future. Writer tasks (one per writer
connection) each take everything queued, commit it as one transaction
(:func:`.batch.run_batch`) and resolve the callers' futures after COMMIT. While
a batch is in flight the next one accumulates, so under load the cost of a
transaction (round trips, the WAL flush) is shared by every append in it.

Why group commit rather than a pool with one transaction per append: measured
with ``bench/store_postgres.py`` on the 2-core development machine (client and
server on the same cores, fsync on), 1,000 conversations appending one event
each concurrently reached 12,000-19,000 events/s in batches of up to 1,000
appends (four round trips and one WAL flush per batch), against
1,600-2,500 events/s with 16 connections and one transaction per append. A
second writer connection did not help there (the appenders wait for their
batch, so there is rarely a second batch to run), hence one writer by default;
with several writers, batches commit in parallel and serialise only on the
rows of the conversations they share, which is the per-conversation order
needed anyway.

A batch runs in its own task, shielded: if a writer task is cancelled mid-batch,
the batch still finishes and its callers still learn the outcome.

When the database cannot write (connection lost, server shutting down, disk
full, a read-only session: see :mod:`.errors`), every caller of the batch gets
StoreUnavailable and the transaction is rolled back (if the connection broke
during COMMIT the outcome is unknown, as with any database). The writer then
drops its connection and opens a fresh one for the next batch, so a session
that was read-only (``default_transaction_read_only`` is read when a session
starts) or half-broken is never reused, and writes resume by themselves once
the server accepts them again. Those failures (and the reconnections) are logged
once per episode, then counted (:class:`~torpor.store.episode.Episode`): callers
retrying while the server is down would otherwise log a line or two each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from torpor._logging import get_logger
from torpor.store.commit_queue import CommitQueue, Failed, Pending, deliver
from torpor.store.episode import Episode
from torpor.store.postgres.batch import BatchStats, run_batch
from torpor.store.postgres.errors import is_unavailable, store_error
from torpor.store.postgres.plan import WriteOp
from torpor.store.prepare import now_ms

__all__ = ["GroupCommitWriter"]

log = get_logger(__name__)

_Pending = Pending[WriteOp]
Connect = Callable[[], Awaitable[asyncpg.Connection]]


class GroupCommitWriter:
    """The queue of write operations and the tasks that commit them in batches."""

    def __init__(
        self, connections: list[asyncpg.Connection], connect: Connect, *, max_batch: int = 2048
    ) -> None:
        self._connections = connections
        self._connect = connect
        self._queue: CommitQueue[WriteOp] = CommitQueue(max_batch)
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self.batches = 0  # committed batches, for stats and tests
        self.largest_batch = 0
        self.stats = BatchStats()
        self._trouble = Episode(  # batches refused by a database that cannot write
            log, "group_commit_failed", ongoing="group_commit_still_failing",
            ended="group_commit_recovered", level="error",
        )

    @property
    def unavailable_since(self) -> float | None:
        """``time.monotonic()`` of the first batch refused since the last commit (None: the
        last batch committed): the database could not write then, and has not since."""
        return self._trouble.since

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(index), name=f"torpor-pg-writer-{index}")
            for index in range(len(self._connections))
        ]

    async def submit(self, op: WriteOp) -> Any:
        """Queue ``op`` and wait for the commit that contains it; its result or its error."""
        running = any(not t.done() for t in self._tasks)
        return await self._queue.submit(op, running=running)

    async def aclose(self) -> None:
        """Commit what is queued, then stop. If this wait is cancelled, so are the writers."""
        self._queue.close()
        tasks = self._tasks
        try:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if self._inflight:  # batches of cancelled writers finish before connections close
                await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _run(self, index: int) -> None:
        try:
            while (batch := await self._queue.next_batch()) is not None:
                task = asyncio.get_running_loop().create_task(self._commit(index, batch))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
                await asyncio.shield(task)
        finally:
            if all(t.done() or t is asyncio.current_task() for t in self._tasks):
                self._queue.fail_pending()

    async def _commit(self, index: int, batch: list[_Pending]) -> None:
        ops = [op for op, _ in batch]
        started = time.perf_counter()
        try:
            conn = await self._connection(index)
            results = await run_batch(conn, ops, now_ms(), self.stats)
        except Exception as exc:
            if is_unavailable(exc):
                self._trouble.fail(ops=len(ops), error=repr(exc))
                self._drop(index)
            else:
                log.error("group_commit_failed", ops=len(ops), error=repr(exc))
            doing = f"group commit of {len(ops)} operations failed"
            results = [Failed(store_error(exc, doing)) for _ in ops]
        else:
            if self._trouble.since is not None:
                self._trouble.succeed()
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        # One debug record per batch (free unless enabled): what serve's metrics read.
        log.debug("group_commit", ops=len(ops), seconds=time.perf_counter() - started)
        deliver([future for _, future in batch], results)

    def _drop(self, index: int) -> None:
        """Abandon a writer connection after the database failed us; the next batch reconnects."""
        conn = self._connections[index]
        if not conn.is_closed():
            conn.terminate()

    async def _connection(self, index: int) -> asyncpg.Connection:
        conn = self._connections[index]
        if conn.is_closed():
            # once per failure episode: while the server is down every batch reconnects
            (log.debug if self._trouble.active else log.warning)("writer_reconnect", writer=index)
            conn = await self._connect()
            self._connections[index] = conn
        return conn
