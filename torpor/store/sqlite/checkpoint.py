"""WAL checkpoints off the commit path: a task of the store with its own connection.

SQLite's automatic checkpoint runs inside the COMMIT that pushes the WAL past
1,000 pages, so every few hundred commits one caller waits for a checkpoint
(two fsyncs and the page copy): that was most of a turn's p99. The writer
connection therefore runs with ``wal_autocheckpoint=0`` and this module keeps
the WAL in check from a separate connection, on that connection's own thread
(passive checkpoints), and on the writer's connection while the writer is
held (the checkpoints that rewind the WAL):

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
most the checkpoint plus ``busy`` seconds of waiting for readers). Its own
errors are logged and retried later, never raised. When readers keep an old
snapshot open for longer than ``busy``, a RESTART cannot rewind the WAL; the
writer is released anyway, and the hard bound is re-armed after ``interval``.

**Priorities** (Linux). A passive checkpoint is mostly the kernel writing the
WAL back (fsync: tens of MB under sustained writes) in the calling thread, for
tens of milliseconds. At normal priority that thread holds a core the event
loop or the writer thread is woken onto, and the wake-up waits for the
scheduler to take it back: ``bench/turns.py --trace`` found about 40% of the
slowest 1% of turns at one conversation overlapping a passive checkpoint,
nearly all of them waiting 1-4 ms for a thread hand-off. The checkpointer's
thread therefore runs as ``SCHED_IDLE`` (that thread only): it gets the cores
nobody else wants, and any woken thread of normal priority preempts it at
once. Only passive checkpoints run there, and nobody waits for them (but see
below). The checkpoints the writer waits for (RESTART, TRUNCATE) run on the
writer's own connection and thread, at the writer's priority, while it is
held; the writer's next batch queues behind the checkpoint on that thread.
(An unprivileged thread cannot leave ``SCHED_IDLE`` again, hence two threads
rather than one switching.)

On a machine whose cores are all busy, a ``SCHED_IDLE`` thread can starve.
A passive checkpoint still running after ``patience`` seconds is therefore
interrupted (``sqlite3_interrupt``; pages already copied stay copied) and run
again, from where the WAL is, on a second connection whose thread has the
normal priority: on a busy machine checkpoints cost what they did before,
only later. When the hard bound holds the writer, a passive checkpoint on the
idle thread is interrupted at once and the RESTART runs on the writer's
thread, so the writer never waits for a starved thread.

Durability is unchanged: commits reach the WAL exactly as before, and both
connections use the store's ``synchronous`` level, so a checkpoint syncs the
WAL before copying it and the database after, as SQLite's own does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiosqlite

from torpor._logging import get_logger
from torpor.errors import ConfigError
from torpor.store.sqlite.hop import hop, interrupt
from torpor.store.sqlite.writer import GroupCommitWriter

__all__ = ["CheckpointPolicy", "Checkpointer", "Mode"]

log = get_logger(__name__)

Mode = Literal["PASSIVE", "RESTART", "TRUNCATE"]

RETRY = 0.01  # seconds between interrupts of a passive checkpoint that must stop


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """When the checkpointer runs; see the module docstring."""

    interval: float = 1.0  # seconds between passive checkpoints while there are writes
    wal_limit: int = 64 * 1024 * 1024  # hard bound on the WAL file, bytes
    idle_after: float = 5.0  # seconds without writes before the WAL is truncated
    busy: float = 0.1  # how long a blocking checkpoint waits for readers
    patience: float = 0.05  # seconds for a passive checkpoint at idle priority, then normal

    def __post_init__(self) -> None:
        for name in ("interval", "idle_after", "busy", "patience"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 3600:
                raise ConfigError(f"checkpoint {name}", "must be more than 0, at most 3600 seconds")
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
        fallback: aiosqlite.Connection,
    ) -> None:
        self._conn = conn  # passive checkpoints (a SCHED_IDLE thread)
        self._fallback = fallback  # passive checkpoints the idle thread did not finish
        self._writer = writer  # its connection runs the blocking ones, while held
        self._policy = policy
        self._busy_ms = int(policy.busy * 1000)
        self._soft = policy.soft_limit
        self._hard = policy.wal_limit
        self._size = 0  # WAL file bytes after the last commit (0: rewound since)
        self._dirty = False  # written since the last passive checkpoint
        self._empty = True  # nothing written since the WAL was last truncated
        self._last_write = 0.0
        self._last_passive = 0.0
        self._hard_armed_at = 0.0  # a failed rewind re-arms the hard bound after `interval`
        self._holding = False  # the hard bound holds the writer until a rewind
        self._idle_run: asyncio.Future[tuple[int, int, int]] | None = None  # on the idle thread
        self._interrupting = False  # we interrupted it (its error is ours, not a failure)
        self._retry: asyncio.TimerHandle | None = None  # interrupting it, until it returns
        self._rewinding = False  # a rewind (writer held) is under way
        self._wakeup: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # For stats and tests.
        self.checkpoints: dict[str, int] = {"PASSIVE": 0, "RESTART": 0, "TRUNCATE": 0}
        self.rewinds = 0  # RESTART/TRUNCATE checkpoints that rewound the WAL
        self.max_wal_bytes = 0  # the largest WAL file size a commit reported
        self.interrupted = 0  # passive checkpoints on the idle thread cut short by the hard bound
        self.starved = 0  # passive checkpoints redone at normal priority after `patience`

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
        # writer committing at close never meets the checkpoint's lock. Only passive
        # ones run there, which nobody needs any more: cut it short (it may be starved).
        for conn in (self._conn, self._fallback):
            waiting = asyncio.ensure_future(hop(conn, _nothing))
            while not waiting.done():
                interrupt(conn)  # again and again: one sent before it started is lost
                await asyncio.wait((waiting,), timeout=RETRY)
            with contextlib.suppress(ValueError, sqlite3.Error):
                waiting.result()

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
                if self._idle_run is not None:  # it may be starved: the rewind does not wait
                    self._interrupt_idle()
            self._wake()

    def _interrupt_idle(self) -> None:
        """Cut the passive checkpoint on the idle thread short; again every ``RETRY`` seconds
        until it has returned, as an interrupt that lands before its statement starts is lost."""
        self._retry = None
        run = self._idle_run
        if run is not None and not run.done() and self._loop is not None:
            self._interrupting = True
            interrupt(self._conn)
            self._retry = self._loop.call_later(RETRY, self._interrupt_idle)

    # the task ----------------------------------------------------------------------

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            if not wakeup.done():
                wakeup.set_result(None)

    async def _sleep(self, loop: asyncio.AbstractEventLoop, seconds: float | None) -> None:
        if seconds is not None and seconds <= 0:
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
                try:
                    await self._step(loop)
                except Exception as exc:  # never the writers' problem: log, try again later
                    log.warning("checkpoint_failed", error=repr(exc))
                    self._hard_armed_at = loop.time() + self._policy.interval
                    self._last_passive = loop.time()
        finally:
            if self._holding:
                self._holding = False
                self._writer.release()

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
        """A passive checkpoint on the idle thread; after ``patience``, on the fallback's."""
        self._dirty = False
        self._last_passive = loop.time()
        run = self._idle_run = asyncio.ensure_future(hop(self._conn, _wal_checkpoint, "PASSIVE"))
        run.add_done_callback(_retrieve)  # if this task is cancelled, nobody else will
        self._interrupting = False
        try:
            await asyncio.wait((run,), timeout=self._policy.patience)
            if not run.done() and not self._holding:  # starved: the rest at normal priority
                self._interrupt_idle()
            await asyncio.wait((run,))
        finally:
            self._idle_run = None
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
        error = run.exception()
        if error is None:
            self.checkpoints["PASSIVE"] += 1
            return
        if not (self._interrupting and isinstance(error, sqlite3.OperationalError)):
            raise error  # a real failure: logged by the task, retried later
        if self._holding:
            self.interrupted += 1  # the rewind that follows copies the rest
            return
        self.starved += 1
        await hop(self._fallback, _wal_checkpoint, "PASSIVE")
        self.checkpoints["PASSIVE"] += 1

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
        else:
            self._hard_armed_at = loop.time() + self._policy.interval
            log.warning("wal_not_rewound", mode=mode, wal_bytes=self._size)
        return rewound

    async def _checkpoint(self, mode: Mode) -> bool:
        """Run one RESTART or TRUNCATE on the writer's connection, which the caller holds
        (see the module docstring); whether it copied the whole WAL and rewound it."""
        busy, frames, copied = await hop(
            self._writer.connection, _blocking_checkpoint, mode, self._busy_ms
        )
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


def _retrieve(run: asyncio.Future[tuple[int, int, int]]) -> None:
    if not run.cancelled():
        run.exception()  # retrieved: the task raises it, unless it was cancelled meanwhile


def _nothing(conn: sqlite3.Connection) -> None:
    return None


def _wal_checkpoint(conn: sqlite3.Connection, mode: Mode) -> tuple[int, int, int]:
    row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def _blocking_checkpoint(
    conn: sqlite3.Connection, mode: Mode, busy_ms: int
) -> tuple[int, int, int]:
    """On the (held) writer's connection: wait at most ``busy_ms`` for readers, not the
    writer's own busy timeout (seconds), then put that back."""
    saved = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
    conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    try:
        return _wal_checkpoint(conn, mode)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {saved}")


def configure_checkpointer(
    conn: sqlite3.Connection, synchronous: str, busy_ms: int, idle: bool
) -> None:
    """A checkpointer's connection (run on its thread): its sync level is what makes a
    checkpoint durable; ``idle``: its thread becomes SCHED_IDLE (Linux; see the module
    docstring)."""
    conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    if idle:
        lower_priority()


def lower_priority() -> bool:
    """Make the calling thread SCHED_IDLE (Linux: a thread id is a process id to the
    scheduler calls); whether it is. Elsewhere, or where forbidden, it stays as it is:
    only the turns' tail suffers, nothing else."""
    if not sys.platform.startswith("linux"):
        return False
    thread = threading.get_native_id()
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return os.sched_getscheduler(thread) == os.SCHED_IDLE
    except OSError:
        return False
