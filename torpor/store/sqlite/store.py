"""SQLiteStore: the default EventStore, one file (or memory) per runtime.

Connections: one writer (group commit, :mod:`.writer`) and, for a file, a few
reader connections so reads never queue behind a commit; WAL lets them read
the last committed snapshot while the writer writes. A private in-memory
database (``sqlite://``) has a single connection that serves both: SQLite
cannot share one in-memory database between connections without shared-cache
mode, whose table locks make readers fail with SQLITE_LOCKED mid-write. Every
read is one hop to a connection thread; a write waits for the group-commit
batch that carries it, one hop there and back for the whole batch. A file
store has one more connection, the checkpointer's (:mod:`.checkpoint`): WAL
checkpoints never run inside a commit.

Durability (``durability=``, SQLite's ``synchronous`` in WAL mode):

* ``"normal"`` (default): an acknowledged append survives the crash of the
  process, SIGKILL included: the commit is in the WAL file (in the OS page
  cache) before ``append`` returns. An operating-system crash or power loss may
  roll back the most recent commits, because the WAL is only fsynced at
  checkpoints; the database is never corrupted either way.
* ``"full"``: the WAL is fsynced at every commit, so an acknowledged append also
  survives power loss. The fsync is paid once per group-commit batch and
  shared by every append in it.

An in-memory store promises nothing beyond the life of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import aiosqlite

from torpor._logging import get_logger
from torpor.errors import ConfigError, StoreError, StoreUnavailable
from torpor.store.core import StoreCore
from torpor.store.fulltext import match_expression
from torpor.store.listing import Deletion
from torpor.store.memory import MemoryRecord
from torpor.store.memory_rows import MemoryWrite
from torpor.store.prepare import PreparedAppend, now_ms
from torpor.store.protocol import (
    Checkpoint,
    HintExtractor,
    ModelCall,
    SearchHit,
    TokenCounter,
)
from torpor.store.schedules import NewSchedule, Schedule
from torpor.store.sqlite import reads
from torpor.store.sqlite.batch import FlushSearchIndex
from torpor.store.sqlite.checkpoint import Checkpointer, CheckpointPolicy, configure_checkpointer
from torpor.store.sqlite.delete import backlog_size, delete_tree, truncate_wal
from torpor.store.sqlite.errors import store_error
from torpor.store.sqlite.hop import hop
from torpor.store.sqlite.memory_ops import MemoryOp, read_memory
from torpor.store.sqlite.redact import redact_event
from torpor.store.sqlite.schedule_ops import AddScheduleOp, RemoveScheduleOp
from torpor.store.sqlite.schema import Durability, configure_reader, configure_writer, migrate
from torpor.store.sqlite.write_ops import (
    AppendOp,
    ArtifactOp,
    CheckpointOp,
    DescribeOp,
    ModelCallOp,
)
from torpor.store.sqlite.writer import GroupCommitWriter

__all__ = ["SQLiteStore"]

log = get_logger(__name__)

T = TypeVar("T")


def _setup_writer(
    conn: sqlite3.Connection, durability: Durability, file: bool, busy_ms: int, wal_keep: int
) -> tuple[int, tuple[int, int]]:
    """Configure and migrate; the schema version and what waits in the search backlog."""
    configure_writer(conn, durability, file=file, busy_ms=busy_ms, wal_keep=wal_keep)
    version = migrate(conn)
    try:
        rows, text = conn.execute(
            "SELECT count(*), total(length(text)) FROM fts_backlog"
        ).fetchone()
    except sqlite3.DatabaseError:  # damaged pages: the reads that meet them say so, not open
        return version, (1, 0)  # maybe not empty: the next flush reads it
    return version, (int(rows), int(text))


def _configure_writer(
    conn: sqlite3.Connection, durability: Durability, busy_ms: int, wal_keep: int
) -> None:
    configure_writer(conn, durability, file=True, busy_ms=busy_ms, wal_keep=wal_keep)


class _Readers:
    """Reader connections; each call goes to the one with the fewest calls in flight."""

    def __init__(self, conns: Sequence[aiosqlite.Connection]) -> None:
        self.conns = list(conns)
        self._busy = [0] * len(self.conns)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        index = min(range(len(self.conns)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            return await hop(self.conns[index], fn, *args)
        except sqlite3.Error as exc:
            raise store_error(exc, "read failed") from exc
        finally:
            self._busy[index] -= 1


class SQLiteStore(StoreCore):
    """An :class:`~torpor.store.protocol.EventStore` over one SQLite database.

    Use as an async context manager (or through :func:`torpor.store.open_store`):
    entering opens the connections, migrates the schema and starts the writer
    task; leaving commits whatever is queued, stops the writer and closes.

    Errors: a file that is not a torpor database (garbage, truncated) raises
    CorruptStore, at open or on the read that finds the damage; a database
    that cannot write (disk full, read-only, locked for longer than
    ``busy_timeout`` seconds) makes writes raise StoreUnavailable while reads
    go on, and writes resume by themselves once it can write again.

    WAL (file stores): ``checkpoint_interval`` seconds at most between passive
    checkpoints while there are writes; ``wal_limit`` bytes is the bound on the
    WAL file (past half of it the WAL is rewound, the writer held for a few
    milliseconds; past all of it no further batch is committed until it is);
    after ``idle_checkpoint`` seconds without writes the WAL is truncated. See
    :mod:`torpor.store.sqlite.checkpoint`.
    """

    reads = reads

    def __init__(
        self,
        path: str | None,
        *,
        token_counter: TokenCounter | None = None,
        hint_extractor: HintExtractor | None = None,
        durability: Durability = "normal",
        artifact_threshold: int = 16 * 1024,
        max_event_bytes: int = 1024 * 1024,
        readers: int = 2,
        max_batch: int = 2048,
        busy_timeout: float = 10.0,
        checkpoint_interval: float = 1.0,
        wal_limit: int = 64 * 1024 * 1024,
        idle_checkpoint: float = 5.0,
    ) -> None:
        super().__init__(
            token_counter=token_counter,
            hint_extractor=hint_extractor,
            durability=durability,
            artifact_threshold=artifact_threshold,
            max_event_bytes=max_event_bytes,
            readers=readers,
            max_batch=max_batch,
        )
        if not isinstance(busy_timeout, int | float) or not 0 <= busy_timeout <= 3600:
            raise ConfigError("busy_timeout", "must be 0..3600 seconds")
        if path is not None and (not isinstance(path, str) or "\x00" in path):
            raise ConfigError("path", "must be a file path without NUL, or None for memory")
        self.path = path
        self._busy_ms = int(busy_timeout * 1000)
        self._checkpoints = CheckpointPolicy(
            interval=checkpoint_interval, wal_limit=wal_limit, idle_after=idle_checkpoint
        )
        self._conns: list[aiosqlite.Connection] = []
        self._writer: GroupCommitWriter | None = None
        self._checkpointer: Checkpointer | None = None
        self._readers: _Readers | None = None
        self._log = log.bind(store=path or ":memory:")

    # lifecycle -------------------------------------------------------------------

    async def open(self) -> None:
        if self._conns:
            raise StoreError("the store is already open")
        checkpointer: aiosqlite.Connection | None = None
        try:
            writer = await self._connect(shared=True)
            version, backlog = await hop(
                writer,
                _setup_writer,
                self.durability,
                self.path is not None,
                self._busy_ms,
                self._checkpoints.soft_limit,
            )
            readers = [writer]
            if self.path is not None:
                readers = [await self._connect() for _ in range(self._reader_count)]
                for reader in readers:
                    await hop(reader, configure_reader, self._busy_ms)
                checkpointer = await self._connect()
                busy_ms = int(self._checkpoints.busy * 1000)
                await hop(checkpointer, configure_checkpointer, self.durability.upper(), busy_ms)
        except BaseException as exc:
            await self._close_connections()
            if isinstance(exc, sqlite3.Error):
                raise store_error(exc, f"cannot open the store {self.path!r}") from exc
            raise
        self._readers = _Readers(readers)
        self._writer = GroupCommitWriter(
            writer,
            reconnect=None if self.path is None else self._reconnect_writer,
            max_batch=self._max_batch,
            wal_path=None if self.path is None else self.path + "-wal",
            search_backlog=backlog,
            # Small batches on the loop's thread when a commit syncs nothing; an in-memory
            # store's one connection also serves reads on its thread, so it never does.
            inline=self.path is not None and self.durability == "normal",
        )
        self._writer.start()
        if checkpointer is not None:
            self._checkpointer = Checkpointer(checkpointer, self._writer, self._checkpoints)
            self._writer.on_commit = self._checkpointer.committed
            self._checkpointer.start()
        self._log.info("store_opened", schema_version=version, durability=self.durability)

    async def _connect(self, *, shared: bool = False) -> aiosqlite.Connection:
        """``shared``: the writer's, usable from the loop's thread too (inline batches)."""
        conn = aiosqlite.connect(
            self.path or ":memory:", isolation_level=None, cached_statements=256,
            check_same_thread=not shared,
        )
        self._conns.append(conn)
        await conn
        return conn

    async def _reconnect_writer(self, old: aiosqlite.Connection) -> aiosqlite.Connection:
        """A fresh writer connection for a file store, configured like the first one.

        Used after errors that can leave a connection unable to write for good
        (one opened while the file was read-only stays read-only). The old one is
        closed only once the new one works, so a failed attempt changes nothing.
        """
        conn = await self._connect(shared=True)
        try:
            keep = self._checkpoints.soft_limit
            await hop(conn, _configure_writer, self.durability, self._busy_ms, keep)
        except BaseException as exc:
            self._conns.remove(conn)
            with contextlib.suppress(Exception):
                await asyncio.shield(conn.close())
            if isinstance(exc, sqlite3.Error):
                raise store_error(exc, "cannot reopen the writer connection") from exc
            raise
        if old in self._conns:
            self._conns.remove(old)
        with contextlib.suppress(Exception):
            await asyncio.shield(old.close())
        return conn

    async def close(self) -> None:
        try:
            await self._settle()  # appends still being prepared off the loop are queued first
            checkpointer, self._checkpointer = self._checkpointer, None
            try:
                if checkpointer is not None:  # first: it may be holding the writer
                    await checkpointer.aclose()
            finally:
                if self._writer is not None:
                    self._writer.on_commit = None
                    await self._writer.aclose()
        finally:
            self._writer = None
            self._readers = None
            await self._close_connections()
            self._log.info("store_closed")

    async def _close_connections(self) -> None:
        conns, self._conns = self._conns, []
        cancelled: asyncio.CancelledError | None = None
        for conn in conns:  # close every one, even if cancelled: each owns a thread
            try:
                with contextlib.suppress(ValueError, sqlite3.Error):  # never connected
                    await asyncio.shield(conn.close())
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled

    def _write(self) -> GroupCommitWriter:
        if self._writer is None:
            raise StoreError("the store is not open")
        return self._writer

    def _read(self) -> _Readers:
        if self._readers is None:
            raise StoreError("the store is not open")
        return self._readers

    @property
    def unavailable_since(self) -> float | None:
        """``time.monotonic()`` when writes started failing for want of a writable
        database (disk full, read-only, I/O error, locked), None while the last write
        committed (or none failed): a hint that costs nothing, for a caller deciding
        whether to wait for the store. Writes themselves say so with StoreUnavailable."""
        writer = self._writer
        return None if writer is None else writer.unavailable_since

    def _forget_head(self, conversation_id: str) -> None:
        """Drop the conversation from the writer's head cache (its agent hibernated: the
        next append reads the head again). Not part of EventStore: the runtime looks for it."""
        if self._writer is not None:
            self._writer.forget_head(conversation_id)

    async def _on_writer(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(sqlite3_connection, *args)`` on the writer connection's thread.

        For tests and maintenance only (e.g. ``PRAGMA max_page_count`` to make
        the database fill up): it bypasses the queue, so the writer is held
        meanwhile (no batch runs beside it on the loop's thread).
        """
        async with self._write().exclusive() as conn:
            return await hop(conn, fn, *args)

    # what StoreCore asks of a backend ----------------------------------------------

    def _submit(self, op: Any) -> asyncio.Future[Any]:
        return self._write().submit(op)

    async def _reading(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._read().run(fn, *args)

    def _append_op(
        self, prepared: PreparedAppend, with_events: bool, audit: ModelCall | None = None
    ) -> AppendOp:
        return AppendOp(prepared, with_events=with_events, audit=audit)

    def _checkpoint_op(self, checkpoint: Checkpoint) -> CheckpointOp:
        return CheckpointOp(checkpoint)

    def _artifact_op(self, conversation_id: str, artifact_id: str, data: bytes) -> ArtifactOp:
        return ArtifactOp(conversation_id, artifact_id, data)

    def _model_call_op(self, call: ModelCall) -> ModelCallOp:
        return ModelCallOp(call)

    async def _write_memory(self, write: MemoryWrite) -> None:
        await self._write().submit(MemoryOp(write))

    async def _read_memory(self, conversation_id: str) -> MemoryRecord:
        return await self._read().run(read_memory, conversation_id)

    async def _describe(self, name: str, title: str | None, metadata: str | None) -> bool:
        return bool(await self._write().submit(DescribeOp(name, title, metadata)))

    async def _add_schedule(self, new: NewSchedule, at_most: int | None) -> Schedule:
        return cast(Schedule, await self._write().submit(AddScheduleOp(new, at_most)))

    async def _remove_schedule(self, name: str, schedule_id: str) -> bool:
        return bool(await self._write().submit(RemoveScheduleOp(name, schedule_id)))

    async def _delete(self, name: str, by: str) -> Deletion | None:
        """On the writer connection with the writer held (see :mod:`.delete`): the delete's
        transaction, then the WAL truncated, before any other batch commits."""
        await self._settle()  # appends still being prepared off the loop land first
        writer = self._write()
        async with writer.exclusive() as conn:
            try:
                deletion = await hop(conn, delete_tree, name, by, now_ms())
                if deletion is None:
                    return None
                for conversation in deletion.conversations:
                    writer.forget_head(conversation)
                writer.search_backlog_size = await hop(conn, backlog_size)
                if self.path is not None and not await hop(conn, truncate_wal):
                    # A reader kept an old snapshot past the busy timeout: the deleted
                    # pages stay in the WAL until the checkpointer's next rewind.
                    self._log.warning("delete_wal_not_truncated", conversation_id=name)
            except sqlite3.Error as exc:
                raise store_error(exc, f"delete of {name!r} failed") from exc
        self._log.info(
            "conversation_deleted", conversation_id=name, by=by,
            conversations=len(deletion.conversations), events=deletion.rows.get("events", 0),
        )
        return deletion

    async def _redact(self, name: str, position: int, reason: str) -> Deletion | None:
        """As ``_delete``: the redaction's transaction, then the WAL truncated, with the
        writer held (see :mod:`.redact`)."""
        await self._settle()
        writer = self._write()
        async with writer.exclusive() as conn:
            try:
                deletion = await hop(
                    conn, redact_event, name, position, reason, now_ms(), self._count_redacted
                )
                if deletion is None:
                    return None
                writer.search_backlog_size = await hop(conn, backlog_size)
                if self.path is not None and not await hop(conn, truncate_wal):
                    self._log.warning("redact_wal_not_truncated", conversation_id=name)
            except sqlite3.Error as exc:
                raise store_error(exc, f"redaction in {name!r} failed") from exc
        self._log.info("event_redacted", conversation_id=name, position=position)
        return deletion

    async def _search(
        self, conversation_id: str, query: str, k: int, exclude: frozenset[str]
    ) -> list[SearchHit]:
        """bm25-ranked: ``query`` becomes an FTS5 expression of literal terms."""
        expression = match_expression(query)
        if expression is None:
            return []
        read = self._read()
        hits = await read.run(
            reads.search, conversation_id, expression, query, k, "ask", exclude
        )
        if hits is None:  # some of its events wait in the search backlog: index them first
            backlog: reads.Backlog = "ignore"
            try:
                await self._write().submit(FlushSearchIndex())
            except StoreUnavailable:  # reads go on while the database cannot write
                backlog = "scan"
            hits = await read.run(
                reads.search, conversation_id, expression, query, k, backlog, exclude
            )
            assert hits is not None
        return hits
