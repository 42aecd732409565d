"""WAL checkpoints off the commit path: a task of the store with its own connection.

SQLite's automatic checkpoint runs inside the COMMIT that pushes the WAL past
1,000 pages, so every few hundred commits one caller waits for a checkpoint
(two fsyncs and the page copy): that was most of a turn's p99. The writer
connection therefore runs with ``wal_autocheckpoint=0`` and this module keeps
the WAL in check from a separate connection, on that connection's own thread:

* **Passive** checkpoints (``PRAGMA wal_checkpoint(PASSIVE)``) while there are
  writes, at most every ``interval`` seconds. They copy what they can without
  taking any lock a writer needs, so commits go on meanwhile. When writes
  leave gaps (any real chat: a model call takes seconds), a passive
  checkpoint catches up with the whole WAL and the next commit starts the WAL
  over from its beginning: the file stops growing without anyone waiting.
* Under **sustained** writes no passive checkpoint ever catches the WAL whole
  (commits keep landing behind it), so the WAL is never restarted and would
  grow forever. Once the file passes the *soft* bound (half of
  ``wal_limit``), a passive checkpoint copies the bulk while writes go on,
  then the writer is *held* (its queue waits, see
  :meth:`~torpor.store.sqlite.writer.GroupCommitWriter.hold`) for a RESTART
  checkpoint that copies the few frames left and rewinds the WAL. That one
  wait (about two fsyncs) is paid once per soft bound of WAL written, instead
  of inside every thousand-page commit.
* The **hard** bound (``wal_limit``): a commit that leaves the WAL file
  larger holds the writer at once (from the writer's completion callback,
  before the next batch can start) until a RESTART checkpoint has run, so the
  file cannot outgrow it by more than one batch, whatever the timing.
* **Idle**: once nothing has been written for ``idle_after`` seconds, a
  TRUNCATE checkpoint (writer held) empties the WAL file.

``journal_size_limit`` is set to the soft bound on the writer, so after a
restart the file is cut back to it: the WAL file's size is then a measure of
how much WAL is in use, which is what the writer reports after every commit.

The checkpointer never makes a write fail: passive checkpoints take no lock a
writer waits for, and the blocking ones run only while the writer is held, so
the writer never meets their lock (writes wait in the queue instead, for at
most the checkpoint plus ``busy`` seconds of waiting for readers). When readers
keep an old snapshot open for longer than ``busy``, a RESTART cannot rewind the
WAL; the writer is released anyway, and the hard bound is re-armed after
``interval``.

**Failures** (a full disk, a read-only or immutable file: a checkpoint that
raises) are never raised, and never retried at once: the next checkpoint of any
kind waits ``retry_first`` seconds, doubling after every further failure up to
``retry_cap``, and the first checkpoint that succeeds resets that. Meanwhile the
writer is held only for the failing checkpoint itself, so writes go on being
tried (and refused with StoreUnavailable, or committed) between attempts. The
failures of one episode are logged once, then counted
(:class:`~torpor.store.episode.Episode`). An idle TRUNCATE that failed and was
retried at once, without ever yielding, once held the writer for good: every
write hung and the log took hundreds of thousands of lines a minute.

Durability is unchanged: commits reach the WAL exactly as before, and the
checkpointer's connection uses the store's ``synchronous`` level, so a
checkpoint syncs the WAL before copying it and the database after, as
SQLite's own does.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiosqlite

from torpor._logging import get_logger
from torpor.errors import ConfigError
from torpor.store.episode import Episode
from torpor.store.sqlite.hop import hop
from torpor.store.sqlite.writer import GroupCommitWriter

__all__ = ["CheckpointPolicy", "Checkpointer", "Mode"]

log = get_logger(__name__)

Mode = Literal["PASSIVE", "RESTART", "TRUNCATE"]


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """When the checkpointer runs; see the module docstring."""

    interval: float = 1.0  # seconds between passive checkpoints while there are writes
    wal_limit: int = 64 * 1024 * 1024  # hard bound on the WAL file, bytes
    idle_after: float = 5.0  # seconds without writes before the WAL is truncated
    busy: float = 0.1  # how long a blocking checkpoint waits for readers
    retry_first: float = 0.05  # after a failed checkpoint, seconds before the next one
    retry_cap: float = 5.0  # that wait doubles after every failure, up to this

    def __post_init__(self) -> None:
        for name in ("interval", "idle_after", "busy", "retry_first", "retry_cap"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 3600:
                raise ConfigError(f"checkpoint {name}", "must be more than 0, at most 3600 seconds")
        if self.retry_first > self.retry_cap:
            raise ConfigError("checkpoint retry_first", "must not be more than retry_cap")
        if type(self.wal_limit) is not int or self.wal_limit < 128 * 1024:
            raise ConfigError("wal_limit", "must be at least 128 KiB")

    @property
    def soft_limit(self) -> int:
        return self.wal_limit // 2


class Checkpointer:
    """The store's checkpoint task: started with the store, cancelled and awaited when it closes.

    ``committed`` is the writer's ``on_commit``: it is called on the event loop
    after every commit with the WAL file's size, and costs a few comparisons.
    """

    def __init__(
        self,
        conn: aiosqlite.Connection,
        writer: GroupCommitWriter,
        policy: CheckpointPolicy,
    ) -> None:
        self._conn = conn
        self._writer = writer
        self._policy = policy
        self._soft = policy.soft_limit
        self._hard = policy.wal_limit
        self._size = 0  # WAL file bytes after the last commit (0: rewound since)
        self._dirty = False  # written since the last passive checkpoint
        self._empty = True  # nothing written since the WAL was last truncated
        self._last_write = 0.0
        self._last_passive = 0.0
        self._hard_armed_at = 0.0  # a failed rewind re-arms the hard bound after `interval`
        self._holding = False  # the hard bound holds the writer until a rewind
        self._rewinding = False  # a rewind (writer held) is under way
        self._backoff = 0.0  # the wait after the last failure (0: the last step succeeded)
        self._retry_at = 0.0  # no checkpoint before this (loop time), after a failure
        self._failing = Episode(
            log, "checkpoint_failed", ongoing="checkpoint_still_failing",
            ended="checkpoint_recovered",
        )
        self._pinned = Episode(  # a reader's snapshot kept a rewind from rewinding
            log, "wal_not_rewound", ongoing="wal_still_not_rewound", ended="wal_rewound"
        )
        self._wakeup: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # For stats and tests.
        self.checkpoints: dict[str, int] = {"PASSIVE": 0, "RESTART": 0, "TRUNCATE": 0}
        self.rewinds = 0  # RESTART/TRUNCATE checkpoints that rewound the WAL
        self.attempts = 0  # checkpoints started, failed ones included
        self.failures = 0  # checkpoints that raised
        self.max_wal_bytes = 0  # the largest WAL file size a commit reported

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._last_passive = self._last_write = loop.time()
        self._task = loop.create_task(self._run(), name="torpor-checkpointer")

    async def aclose(self) -> None:
        """Stop: cancel the task, wait for it, and for a checkpoint still on the thread."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # A checkpoint that was running when the task was cancelled goes on on its
        # thread; the next call on the connection runs after it. Wait for that, so a
        # writer committing at close never meets the checkpoint's lock.
        with contextlib.suppress(ValueError, sqlite3.Error):
            await asyncio.shield(hop(self._conn, _nothing))

    # called by the writer, on the loop ---------------------------------------------

    def committed(self, wal_bytes: int) -> None:
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        self._size = wal_bytes
        if wal_bytes > self.max_wal_bytes:
            self.max_wal_bytes = wal_bytes
        self._last_write = now
        self._empty = False
        if not self._dirty:
            self._dirty = True
            self._wake()
        if wal_bytes > self._soft:
            if (
                wal_bytes > self._hard
                and not self._holding
                and not self._rewinding
                and now >= self._hard_armed_at
                and self._task is not None
            ):
                self._holding = True
                self._writer.hold()  # before the writer can take its next batch
            self._wake()

    # the task ----------------------------------------------------------------------

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            if not wakeup.done():
                wakeup.set_result(None)

    async def _sleep(self, loop: asyncio.AbstractEventLoop, seconds: float | None) -> None:
        if seconds is not None and seconds <= 0:
            # Yield all the same: a writer released a moment ago must get to run before
            # this task can hold it again.
            await asyncio.sleep(0)
            return
        wakeup = self._wakeup = loop.create_future()
        timer = None if seconds is None else loop.call_later(seconds, _resolve, wakeup)
        try:
            await wakeup
        finally:
            if timer is not None:
                timer.cancel()
            if self._wakeup is wakeup:
                self._wakeup = None

    def _due(self, now: float) -> float | None:
        """Seconds until there is something to do (0: now), None: until a commit says so."""
        due = self._work(now)
        if due is not None and self._retry_at > now:  # backing off after a failure
            due = max(due, self._retry_at - now)
        return due

    def _work(self, now: float) -> float | None:
        if self._holding:
            return 0.0
        if self._size > self._soft and now >= self._hard_armed_at:
            return 0.0
        due: float | None = None
        if self._dirty:
            due = self._last_passive + self._policy.interval - now
        if not self._empty:
            idle = self._last_write + self._policy.idle_after - now
            due = idle if due is None else min(due, idle)
        return due

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._sleep(loop, self._due(loop.time()))
                if loop.time() < self._retry_at:  # woken by a commit while backing off
                    continue
                attempts = self.attempts
                try:
                    await self._step(loop)
                except Exception as exc:  # never the writers' problem: log, try again later
                    self._failed(loop, exc)
                else:
                    if self.attempts != attempts:  # a checkpoint ran, and all went well
                        self._backoff = self._retry_at = 0.0
                        self._failing.succeed()
        finally:
            if self._holding:
                self._holding = False
                self._writer.release()

    def _failed(self, loop: asyncio.AbstractEventLoop, exc: Exception) -> None:
        """Back off: nothing is tried for a while, longer after every failure in a row."""
        policy = self._policy
        now = loop.time()
        self.failures += 1
        self._backoff = (
            min(self._backoff * 2, policy.retry_cap) if self._backoff else policy.retry_first
        )
        self._retry_at = now + self._backoff
        self._hard_armed_at = max(now + policy.interval, self._retry_at)
        self._last_passive = now
        if self._holding:  # the hard bound held the writer during a failed passive one:
            self._holding = False  # let it go, writes must not wait out the back-off
            self._writer.release()
        self._failing.fail(error=repr(exc), retry_in=self._backoff)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if self._holding:  # a commit left the WAL past the hard bound; the writer waits
            await self._rewind(loop, "RESTART", held=True)
            return
        if self._size > self._soft and now >= self._hard_armed_at:
            await self._passive(loop)  # the bulk, while writes go on
            # (the hard bound may have held the writer meanwhile: this rewind takes it over)
            await self._rewind(loop, "RESTART", held=self._holding)
            return
        if not self._empty and now >= self._last_write + self._policy.idle_after:
            if await self._rewind(loop, "TRUNCATE"):
                if self._last_write <= now:
                    self._empty = True  # unless a write came in meanwhile
            else:  # a reader holds an old snapshot: try again after another idle spell
                self._last_write = loop.time()
            return
        if self._dirty and now >= self._last_passive + self._policy.interval:
            await self._passive(loop)

    async def _passive(self, loop: asyncio.AbstractEventLoop) -> None:
        self._dirty = False
        self._last_passive = loop.time()
        await self._checkpoint("PASSIVE")

    async def _rewind(
        self, loop: asyncio.AbstractEventLoop, mode: Mode, *, held: bool = False
    ) -> bool:
        """A checkpoint that rewinds the WAL, with the writer held; whether it did.

        ``held``: the hard bound's hold is already on; this call takes it over.
        The hold is released once the checkpoint is over, even if this task is
        cancelled meanwhile (the checkpoint goes on on its thread until done).
        """
        writer = self._writer
        if held:
            self._holding = False
        else:
            writer.hold()
        deferred = False
        self._rewinding = True
        try:
            await writer.quiesce()
            run = asyncio.ensure_future(self._checkpoint(mode))
            try:
                rewound = await asyncio.shield(run)
            except asyncio.CancelledError:
                run.add_done_callback(_releaser(writer))
                deferred = True
                raise
        finally:
            self._rewinding = False
            if not deferred:
                writer.release()
        self._dirty = False
        self._last_passive = loop.time()
        if rewound:
            self.rewinds += 1
            self._size = 0
            self._pinned.succeed(mode=mode)
        else:
            self._hard_armed_at = loop.time() + self._policy.interval
            self._pinned.fail(mode=mode, wal_bytes=self._size)
        return rewound

    async def _checkpoint(self, mode: Mode) -> bool:
        """Run one checkpoint; whether it copied the whole WAL (and, unless PASSIVE, rewound it)."""
        self.attempts += 1
        busy, frames, copied = await hop(self._conn, _wal_checkpoint, mode)
        self.checkpoints[mode] += 1
        return busy == 0 and frames == copied


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _releaser(writer: GroupCommitWriter) -> Callable[[asyncio.Future[bool]], None]:
    def release(run: asyncio.Future[bool]) -> None:
        if not run.cancelled():
            run.exception()  # retrieved: logged by nobody, the store is closing
        writer.release()

    return release


def _nothing(conn: sqlite3.Connection) -> None:
    return None


def _wal_checkpoint(conn: sqlite3.Connection, mode: Mode) -> tuple[int, int, int]:
    row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def configure_checkpointer(conn: sqlite3.Connection, synchronous: str, busy_ms: int) -> None:
    """The checkpointer's connection: its sync level is what makes a checkpoint durable."""
    conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
