"""Group commit: many concurrent writes, one writer connection, one transaction per batch.

Callers queue an operation and await a future. A single writer task, owned by
the store (started when it opens, awaited when it closes), takes everything
queued and hands it to the writer connection's thread as one job
(:func:`~torpor.store.sqlite.hop.post`): one transaction (:func:`run_batch`),
then one ``call_soon_threadsafe`` back to the event loop that resolves every
caller's future and wakes the writer task. That is the whole round trip: one
hand-off to the thread and one back per batch, whatever its size. While a
batch is on the writer thread the next one accumulates, so under load a batch
holds roughly everything that arrived during the previous commit: the
per-transaction cost is shared instead of paid per append.

Callers are resolved before the writer task resumes, so what they write as
soon as they learn their result (a turn's next message) joins the very next
batch instead of waiting for a later one.

When the database cannot write (see :mod:`.errors`), the whole batch fails
with StoreUnavailable and the writer carries on: the next batch is tried as
usual, so writes resume by themselves once the condition clears. After the
errors that can leave the connection itself unable to write (read-only, I/O),
the store's ``reconnect`` replaces it before the next batch. Such failures
are logged once per episode, then counted (:class:`~torpor.store.episode.Episode`):
callers that retry while the disk stays full would otherwise log a line each.

**Inline batches.** With ``inline`` (a file store at ``synchronous=NORMAL``, where
a commit writes to the WAL and syncs nothing), a batch of at most
:data:`INLINE_OPS` operations runs on the event loop's own thread instead: a
small transaction costs tens of microseconds, while the two cross-thread
wake-ups of a hand-off cost more than that on a virtual machine and make the
slowest turns slower still. The writer connection is then shared by two
threads, never at once: a batch runs whole inside one call on either side, and
anything else that uses the connection holds the writer first
(:meth:`GroupCommitWriter.exclusive`). An inline batch that takes longer than
:data:`SLOW_INLINE` seconds (a stalled disk) sends the next
:data:`AFTER_SLOW` batches to the thread, so the loop is not blocked again at
once; larger batches, under load, always go to the thread, where SQLite's own
work runs beside the loop's instead of inside it; so do batches known to be costly
before they run: more than :data:`INLINE_BYTES` of data, or one that indexes the
search backlog (see :class:`~.batch.SearchBacklog`). An inline batch never waits for
a lock: it runs with ``busy_timeout`` 0, and a batch that meets the write lock
held elsewhere (another process) goes to the thread whole, to wait there for
the configured ``busy_timeout`` (the next :data:`AFTER_SLOW` batches with it).

The writer can be *held* (:meth:`GroupCommitWriter.hold`): it finishes the
batch in flight and takes no new one until released. The WAL checkpointer
(:mod:`.checkpoint`) holds it for the rare checkpoint that needs the database
to itself, so writes wait in the queue instead of failing on SQLite's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiosqlite

from torpor._logging import get_logger
from torpor.errors import CorruptStore, StoreError, StoreUnavailable
from torpor.store.commit_queue import CommitQueue, Failed, Pending, deliver
from torpor.store.episode import Episode
from torpor.store.prepare import now_ms
from torpor.store.sqlite.batch import (
    FlushSearchIndex,
    HeadCache,
    SearchBacklog,
    WriteOp,
    run_batch,
)
from torpor.store.sqlite.errors import RECONNECT, UNAVAILABLE, primary_code, store_error
from torpor.store.sqlite.hop import post
from torpor.store.sqlite.write_ops import AppendOp, ArtifactOp

__all__ = ["GroupCommitWriter"]

log = get_logger(__name__)

INLINE_OPS = 8
"""The largest batch committed on the event loop's thread (``inline`` writers)."""
SLOW_INLINE = 0.005
"""An inline batch slower than this (seconds) sends the next ones to the thread."""
AFTER_SLOW = 200
"""How many batches go to the thread after a slow inline one."""
INLINE_BYTES = 64 * 1024
"""A batch carrying more (event bodies, their text, artifacts) commits on the thread."""

_Pending = Pending[WriteOp]
Reconnect = Callable[[aiosqlite.Connection], Awaitable[aiosqlite.Connection]]
OnCommit = Callable[[int], None]


class GroupCommitWriter:
    """The single writer: a queue of operations and the task that commits them in batches.

    One batch is in flight at a time. Letting the event loop prepare the next
    batch while the thread commits the previous one was measured and lost:
    both sides need the GIL for their Python work, and the thread then waits
    for the loop's switch interval after every SQLite call.

    ``wal_path``: the WAL file, whose size is read on the writer thread after
    every commit and handed to ``on_commit`` (the checkpointer's gauge).
    ``search_backlog``: (rows, text bytes) in ``fts_backlog`` when the store opened.
    """

    def __init__(
        self,
        conn: aiosqlite.Connection,
        *,
        reconnect: Reconnect | None = None,
        max_batch: int = 2048,
        cache_size: int = 65536,
        wal_path: str | None = None,
        search_backlog: tuple[int, int] = (0, 0),
        inline: bool = False,
    ) -> None:
        self._conn = conn
        self._inline = inline  # small batches on the loop's thread (see the module docstring)
        self._threaded = 0  # batches still to send to the thread after a slow inline one
        # The connection's busy_timeout (ms) while it runs with 0 for inline batches, which
        # must not wait for a lock on the loop's thread; None: it has its own.
        self._waits: int | None = None
        self._reconnect = reconnect  # None: keep the connection (an in-memory database)
        self._stale = False  # replace the connection before the next batch
        self._reconnected = False  # in the current failure episode (logged once)
        self._trouble = Episode(  # batches refused by a database that cannot write
            log, "group_commit_failed", ongoing="group_commit_still_failing",
            ended="group_commit_recovered", level="error",
        )
        self._cache = HeadCache(cache_size)
        # Full-text rows are indexed in bulk once 2,048 wait (or 64 KiB of text). That bulk
        # insert goes to the writer thread (see _light), where the commit it joins takes
        # 2.5 ms: one turn in about 1,000 at one conversation (bench/turns.py --trace). At
        # 512 rows (1 ms) it was one in 250, and with the turns that overlap a WAL
        # checkpoint that was the slowest 1%: p99/p50 1.9-2.2 then, 1.4-1.9 now. A search
        # that meets its conversation's rows still waiting has them indexed first.
        self._backlog = SearchBacklog(search_backlog, flush_rows=2048, flush_bytes=64 * 1024)
        self._wal_path = wal_path
        self.on_commit: OnCommit | None = None  # WAL bytes after each commit, on the loop
        self._queue: CommitQueue[WriteOp] = CommitQueue(max_batch)
        self._current: asyncio.Future[None] | None = None  # the batch in flight
        self._holds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # committed batches, for stats and tests
        self.inline_batches = 0  # of which run on the loop's thread
        self.largest_batch = 0

    def forget_head(self, conversation_id: str) -> None:
        """Drop a conversation's cached head (safe from the event loop: the cache locks)."""
        self._cache.forget(conversation_id)

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="torpor-writer")

    def submit(self, op: WriteOp) -> asyncio.Future[Any]:
        """Queue ``op``; a future of the commit that contains it: its result or its error.

        A plain function, not a coroutine: a write waiting for its batch holds
        its caller's frame and this future, nothing more (with 10,000 turns in
        flight, every object a waiting write keeps alive is one more for the
        cyclic GC to walk). Cancelling the future before its batch is taken
        withdraws the write.
        """
        task = self._task
        return self._queue.put(op, running=task is not None and not task.done())

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

    # holding, for the checkpointer ---------------------------------------------------

    def hold(self) -> None:
        """Take no new batch until :meth:`release` (the one in flight still commits).

        A closing writer ignores holds: what was queued before close is committed.
        """
        self._holds += 1

    def release(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            self._queue.wake()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[aiosqlite.Connection]:
        """The writer connection, with no batch in flight or starting until the block ends."""
        self.hold()
        try:
            await self.quiesce()
            yield self._conn
        finally:
            self.release()

    async def quiesce(self) -> None:
        """Return once no batch is on the writer thread (call after :meth:`hold`)."""
        current = self._current
        while current is not None:
            await asyncio.wait((current,))
            current = self._current

    # the writer task -----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        try:
            while True:
                if queue and (not self._holds or queue.closing):
                    batch = queue.take()
                    if batch:
                        await self._commit(loop, batch)
                    del batch  # not kept while waiting: see _job
                    continue
                if queue.closing and not queue:
                    return
                await queue.wait()
        finally:
            queue.fail_pending()

    @property
    def connection(self) -> aiosqlite.Connection:
        return self._conn

    @property
    def unavailable_since(self) -> float | None:
        """``time.monotonic()`` of the first batch refused since the last commit (None: the
        last batch committed): the database could not write then, and has not since."""
        return self._trouble.since

    @property
    def search_backlog(self) -> int:
        """Rows written but not yet full-text indexed, as of the last commit."""
        return self._backlog.size[0]

    @property
    def search_backlog_size(self) -> tuple[int, int]:
        """(rows, text characters) of the search backlog as of the last commit."""
        return self._backlog.size

    @search_backlog_size.setter
    def search_backlog_size(self, size: tuple[int, int]) -> None:
        """What a transaction run outside the batches (a delete, writer held) left."""
        self._backlog.size = size

    async def _commit(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        done: asyncio.Future[None] = loop.create_future()
        self._current = done
        futures = [future for _, future in batch]
        ops = [op for op, _ in batch]
        started = time.perf_counter()
        try:
            try:
                if self._stale and self._reconnect is not None:
                    self._conn = await self._reconnect(self._conn)
                    self._stale = False
                    self._waits = None  # a new connection, configured as the first one
                    # once per failure episode: a retried write reconnects each time
                    (log.debug if self._reconnected else log.info)("writer_reconnected")
                    self._reconnected = True
                if (
                    self._inline and len(ops) <= INLINE_OPS and not self._threaded
                    and self._light(ops) and self._run_inline(ops, futures, done, started)
                ):
                    return
                job, lost = self._job(loop, ops, futures, done, started)
                if self._threaded:
                    self._threaded -= 1
                post(self._conn, job, lost)
                self._waits = None  # the job sets the connection's own busy_timeout back
            except BaseException as exc:  # the reconnect or the hand-off failed: tell everyone
                if isinstance(exc, Exception):
                    self._failed(len(ops), exc)
                for future in futures:
                    if not future.done():
                        future.set_exception(
                            _unavailable(exc)
                            if isinstance(exc, Exception)
                            else StoreError("the store closed before this write was committed")
                        )
                if isinstance(exc, Exception):
                    return
                raise
            # If this task is cancelled now, the batch still finishes on its thread and
            # ``_finish`` still resolves its callers' futures.
            await done
        finally:
            if self._current is done:
                self._current = None

    def _light(self, ops: list[WriteOp]) -> bool:
        """Whether a small batch is also cheap: little data, and no full-text indexing of
        the search backlog (hundreds of rows, milliseconds), which would hold up every
        task on the loop's thread (a slow batch is only known once it has run)."""
        rows = size = text = 0
        for op in ops:
            kind = type(op)
            if kind is AppendOp:
                assert isinstance(op, AppendOp)
                for event in op.append.events:
                    rows += 1
                    text += len(event.text)
                    size += len(event.body)
                    if event.artifact_data is not None:
                        size += len(event.artifact_data)
            elif kind is ArtifactOp:
                assert isinstance(op, ArtifactOp)
                size += len(op.data)
            elif kind is FlushSearchIndex:
                return False
        return size + text <= INLINE_BYTES and not self._backlog.indexes(rows, text)

    def _run_inline(
        self,
        ops: list[WriteOp],
        futures: list[asyncio.Future[Any]],
        done: asyncio.Future[None],
        started: float,
    ) -> bool:
        """Run the batch here, on the loop's thread, and resolve its callers at once.

        False: nothing was committed because another connection holds the write
        lock; the caller sends the batch to the thread, to wait for it there.
        """
        try:
            raw: sqlite3.Connection = self._conn._conn
            if self._waits is None:  # never sleep in the busy handler on the loop's thread
                self._waits = int(raw.execute("PRAGMA busy_timeout").fetchone()[0])
                raw.execute("PRAGMA busy_timeout = 0")
        except BaseException as exc:  # the connection is gone: as post's ``lost``
            results: list[object] = [Failed(_unavailable(exc)) for _ in ops]
            self._finish(futures, done, results, exc, -1, started)
            return True
        results, error, size = self._execute(raw, ops)
        if isinstance(error, sqlite3.Error) and primary_code(error) == sqlite3.SQLITE_BUSY:
            self._threaded = AFTER_SLOW  # rolled back whole: the thread waits for the lock
            log.debug("inline_commit_busy")
            return False
        self.inline_batches += 1
        if time.perf_counter() - started > SLOW_INLINE:
            self._threaded = AFTER_SLOW
            log.debug("inline_commit_slow", seconds=time.perf_counter() - started)
        self._finish(futures, done, results, error, size, started)
        return True

    def _execute(
        self, conn: sqlite3.Connection, ops: list[WriteOp]
    ) -> tuple[list[object], BaseException | None, int]:
        """One batch on ``conn`` (whichever thread): results, the batch's error, WAL bytes."""
        try:
            results, error = run_batch(conn, self._cache, self._backlog, ops, now_ms())
        except BaseException as exc:  # run_batch reports its own failures; a bug otherwise
            results, error = [Failed(_unavailable(exc)) for _ in ops], exc
        size = -1
        wal = self._wal_path
        if wal is not None and error is None:
            try:
                size = os.stat(wal).st_size
            except OSError:
                size = 0  # unknown: the checkpointer still learns that a commit was made
        return results, error, size

    def _job(
        self,
        loop: asyncio.AbstractEventLoop,
        ops: list[WriteOp],
        futures: list[asyncio.Future[Any]],
        done: asyncio.Future[None],
        started: float,
    ) -> tuple[Callable[[sqlite3.Connection], None], Callable[[BaseException], None]]:
        """The batch as it runs on the writer thread, and what it does if the connection is gone."""
        finish = self._finish
        execute = self._execute
        waits = self._waits  # set back first: the thread's batches wait for locks again
        # The connection's thread keeps its last job until the next one arrives: the job
        # lets go of the batch once reported, or a burst's last batch (its operations,
        # events and futures) would stay, pinning the heap freed around it.
        held: list[Any] = [ops, futures]

        def report(results: list[object], error: BaseException | None, size: int) -> None:
            waiting = held[1]
            held.clear()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(finish, waiting, done, results, error, size, started)

        def job(conn: sqlite3.Connection) -> None:
            batch: list[WriteOp] = held[0]  # not the closure's: this frame ends with the job
            if waits is not None:
                try:
                    conn.execute(f"PRAGMA busy_timeout = {waits}")
                except sqlite3.Error as exc:
                    report([Failed(_unavailable(exc)) for _ in batch], exc, -1)
                    return
            outcome = execute(conn, batch)
            del batch
            report(*outcome)

        def lost(exc: BaseException) -> None:
            report([Failed(_unavailable(exc)) for _ in held[0]], exc, -1)

        return job, lost

    def _finish(
        self,
        futures: list[asyncio.Future[Any]],
        done: asyncio.Future[None],
        results: list[object],
        error: BaseException | None,
        wal_size: int,
        started: float,
    ) -> None:
        """On the loop: every caller learns its outcome, then the writer task may go on."""
        if error is None:
            if self._trouble.since is not None:
                self._trouble.succeed()
                self._reconnected = False
            self.batches += 1
            if len(futures) > self.largest_batch:
                self.largest_batch = len(futures)
            # One debug record per batch (free unless enabled): what serve's metrics read.
            log.debug(
                "group_commit",
                ops=len(futures),
                failed=sum(type(result) is Failed for result in results),
                seconds=time.perf_counter() - started,
            )
        else:
            self._failed(len(futures), error)
            if isinstance(error, sqlite3.Error) and primary_code(error) in RECONNECT:
                self._stale = True
        deliver(futures, results)
        if not done.done():
            done.set_result(None)
        on_commit = self.on_commit
        if on_commit is not None and wal_size >= 0:
            on_commit(wal_size)


    def _failed(self, ops: int, error: BaseException) -> None:
        """Log a batch that failed whole: a database that cannot write once per episode
        (its callers may retry for as long as it lasts), anything else every time."""
        if (
            primary_code(error) in UNAVAILABLE
            if isinstance(error, sqlite3.Error)
            else isinstance(_unavailable(error), StoreUnavailable)
        ):
            self._trouble.fail(ops=ops, error=repr(error))
        else:
            log.error("group_commit_failed", ops=ops, error=repr(error))


def _unavailable(exc: BaseException) -> StoreError:
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
