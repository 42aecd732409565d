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
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import aiosqlite
import msgspec

from torpor._logging import get_logger
from torpor.errors import ConfigError, InvalidInput, StoreError, StoreUnavailable
from torpor.events import Body, Event
from torpor.store.admit import admit_model_call, check_checkpoint
from torpor.store.arguments import (
    check_after,
    check_conversation_id,
    check_limit,
    check_position,
    check_turn,
    search_query,
)
from torpor.store.fulltext import match_expression
from torpor.store.prepare import AppendPolicy, new_artifact_id, now_ms
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    ModelCall,
    PendingApproval,
    Resume,
    SearchHit,
    TokenCounter,
)
from torpor.store.sqlite import reads
from torpor.store.sqlite.batch import FlushSearchIndex
from torpor.store.sqlite.checkpoint import Checkpointer, CheckpointPolicy, configure_checkpointer
from torpor.store.sqlite.errors import store_error
from torpor.store.sqlite.hop import hop
from torpor.store.sqlite.schema import Durability, configure_reader, configure_writer, migrate
from torpor.store.sqlite.write_ops import AppendOp, ArtifactOp, CheckpointOp, ModelCallOp
from torpor.store.sqlite.writer import GroupCommitWriter
from torpor.text import check_id

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


class SQLiteStore:
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

    def __init__(
        self,
        path: str | None,
        *,
        token_counter: TokenCounter | None = None,
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
        if durability not in ("normal", "full"):
            raise ConfigError("durability", f"must be 'normal' or 'full', got {durability!r}")
        if type(readers) is not int or readers < 1:
            raise ConfigError("readers", "at least one reader connection is needed")
        if type(max_batch) is not int or max_batch < 1:
            raise ConfigError("max_batch", "must be at least 1")
        if not isinstance(busy_timeout, int | float) or not 0 <= busy_timeout <= 3600:
            raise ConfigError("busy_timeout", "must be 0..3600 seconds")
        if path is not None and (not isinstance(path, str) or "\x00" in path):
            raise ConfigError("path", "must be a file path without NUL, or None for memory")
        self.path = path
        self.durability: Durability = durability
        self._policy = AppendPolicy(
            token_counter=token_counter,
            artifact_threshold=artifact_threshold,
            max_event_bytes=max_event_bytes,
        )
        self._reader_count = readers
        self._max_batch = max_batch
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

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        if self._conns:
            raise StoreError("the store is already open")
        checkpointer: aiosqlite.Connection | None = None
        try:
            writer = await self._connect()
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
        )
        self._writer.start()
        if checkpointer is not None:
            self._checkpointer = Checkpointer(checkpointer, self._writer, self._checkpoints)
            self._writer.on_commit = self._checkpointer.committed
            self._checkpointer.start()
        self._log.info("store_opened", schema_version=version, durability=self.durability)

    async def _connect(self) -> aiosqlite.Connection:
        conn = aiosqlite.connect(
            self.path or ":memory:", isolation_level=None, cached_statements=256
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
        conn = await self._connect()
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

    async def _on_writer(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(sqlite3_connection, *args)`` on the writer connection's thread.

        For tests and maintenance only (e.g. ``PRAGMA max_page_count`` to make
        the database fill up): it bypasses the queue, so it must not write.
        """
        return await hop(self._write().connection, fn, *args)

    # writes ----------------------------------------------------------------------

    async def append(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
    ) -> list[int]:
        prepared = self._policy.prepare(
            conversation_id, events, turn=turn, expect_head=expect_head, key=key
        )
        return cast(list[int], await self._write().submit(AppendOp(prepared)))

    async def append_events(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
    ) -> list[Event]:
        """Like :meth:`append`, returning the events as stored (clipped bodies, token counts)."""
        prepared = self._policy.prepare(
            conversation_id, events, turn=turn, expect_head=expect_head, key=key
        )
        op = AppendOp(prepared, with_events=True)
        return cast(list[Event], await self._write().submit(op))

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._write().submit(CheckpointOp(check_checkpoint(checkpoint)))

    async def put_artifact(self, conversation_id: str, data: bytes) -> str:
        check_conversation_id(conversation_id)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput("data", "artifact data must be bytes")
        op = ArtifactOp(conversation_id, new_artifact_id(), bytes(data))
        return cast(str, await self._write().submit(op))

    async def record_model_call(self, call: ModelCall) -> None:
        """Store one audit row; a ``created_at`` of 0 is stamped with the current time."""
        call = admit_model_call(call)
        if not call.created_at:
            call = msgspec.structs.replace(call, created_at=now_ms())
        await self._write().submit(ModelCallOp(call))

    # reads -----------------------------------------------------------------------

    async def head(self, conversation_id: str) -> int | None:
        check_conversation_id(conversation_id)
        return await self._read().run(reads.head, conversation_id)

    async def read_since(self, conversation_id: str, position: int) -> list[Event]:
        check_conversation_id(conversation_id)
        check_position(position)
        return await self._read().run(reads.read_since, conversation_id, position)

    async def read_range(self, conversation_id: str, start: int, end: int) -> list[Event]:
        check_conversation_id(conversation_id)
        check_position(start, "start")
        check_position(end, "end")
        return await self._read().run(reads.read_range, conversation_id, start, end)

    async def page_backward(
        self, conversation_id: str, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        check_conversation_id(conversation_id)
        if before is not None:
            check_position(before, "before")
        check_limit(limit)
        return await self._read().run(reads.page_backward, conversation_id, before, limit)

    async def resume(self, conversation_id: str) -> Resume:
        check_conversation_id(conversation_id)
        return await self._read().run(reads.resume, conversation_id)

    async def latest_checkpoint(self, conversation_id: str) -> Checkpoint | None:
        check_conversation_id(conversation_id)
        return await self._read().run(reads.latest_checkpoint, conversation_id)

    async def checkpoints(self, conversation_id: str) -> list[Checkpoint]:
        check_conversation_id(conversation_id)
        return await self._read().run(reads.checkpoints, conversation_id)

    async def search(self, conversation_id: str, query: str, k: int = 10) -> list[SearchHit]:
        """bm25-ranked events of one conversation; every term of ``query`` is matched literally."""
        check_conversation_id(conversation_id)
        check_limit(k, "k")
        query = search_query(query)
        expression = match_expression(query)
        if expression is None:
            return []
        read = self._read()
        hits = await read.run(reads.search, conversation_id, expression, query, k, "ask")
        if hits is None:  # some of its events wait in the search backlog: index them first
            backlog: reads.Backlog = "ignore"
            try:
                await self._write().submit(FlushSearchIndex())
            except StoreUnavailable:  # reads go on while the database cannot write
                backlog = "scan"
            hits = await read.run(reads.search, conversation_id, expression, query, k, backlog)
            assert hits is not None
        return hits

    async def get_artifact(self, artifact_id: str) -> bytes:
        """The full bytes of an artifact; UnknownArtifact (a KeyError) if there is none."""
        check_id(artifact_id, "artifact_id")
        return await self._read().run(reads.get_artifact, artifact_id)

    async def model_calls(
        self, conversation_id: str, *, turn: int | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """The most recent ``limit`` calls (of ``turn`` if given), oldest first."""
        check_conversation_id(conversation_id)
        if turn is not None:
            check_turn(turn)
        check_limit(limit)
        return await self._read().run(reads.model_calls, conversation_id, turn, limit)

    async def conversations(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[ConversationInfo]:
        """Conversations ordered by id, those after ``after`` (keyset pagination)."""
        check_after(after)
        check_limit(limit)
        return await self._read().run(reads.conversations, after, limit)

    async def conversation(self, conversation_id: str) -> ConversationInfo | None:
        check_conversation_id(conversation_id)
        return await self._read().run(reads.conversation, conversation_id)

    async def pending(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[PendingApproval]:
        """Conversations waiting on outside answers, by id, after ``after``: from the index."""
        check_after(after)
        check_limit(limit)
        return await self._read().run(reads.pending, after, limit)
