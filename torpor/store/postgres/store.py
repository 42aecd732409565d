"""PostgresStore: the EventStore on PostgreSQL, for several runtime processes on one log.

Same semantics as :class:`~torpor.store.sqlite.SQLiteStore`, by construction:
appends are prepared by the same :class:`~torpor.store.prepare.AppendPolicy`
(validation, token counting, clip-on-entry of large tool results), rows decode
through the same functions, and writes go through the same plan-then-write
group commit. What PostgreSQL adds is that other processes may write the same
database at the same time; see :mod:`.batch` for how positions stay dense.

Connections: ``writers`` dedicated writer connections (group commit,
:mod:`.writer`) and a pool of up to ``readers`` connections for reads, so a read
never queues behind a commit. The URL goes to asyncpg as is; its query
parameters become server settings (``?search_path=torpor`` puts the tables in
a schema of that name, which must exist).

Durability (``durability=``): ``"normal"`` leaves ``synchronous_commit`` as
the server or role configures it (PostgreSQL's default, ``on``, means an
acknowledged append survives a crash of the server and of the machine);
``"full"`` sets ``synchronous_commit = on`` on the writer connections, so an
acknowledged append is flushed to the WAL (and to synchronous standbys, if any)
even where the server default is weaker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import asyncpg
import msgspec

from torpor._logging import get_logger
from torpor.errors import ConfigError, InvalidInput, StoreError
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
from torpor.store.postgres import reads
from torpor.store.postgres.errors import is_unavailable, store_error
from torpor.store.postgres.plan import AppendOp, ArtifactOp, CheckpointOp, ModelCallOp
from torpor.store.postgres.schema import migrate
from torpor.store.postgres.writer import GroupCommitWriter
from torpor.store.prepare import AppendPolicy, PreparedAppend, new_artifact_id, now_ms
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    HintExtractor,
    ModelCall,
    PendingApproval,
    Resume,
    SearchHit,
    TokenCounter,
)
from torpor.store.rows import compress_artifact
from torpor.store.sqlite.schema import Durability
from torpor.text import check_id

__all__ = ["PostgresStore"]

log = get_logger(__name__)

T = TypeVar("T")


_check_id = check_conversation_id
_DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
)


class PostgresStore:
    """An :class:`~torpor.store.protocol.EventStore` over one PostgreSQL database.

    Use as an async context manager (or through :func:`torpor.store.open_store`
    with a ``postgresql://`` or ``postgres://`` URL): entering connects,
    migrates the schema and starts the writers; leaving commits whatever is
    queued, stops the writers and closes every connection.
    """

    def __init__(
        self,
        dsn: str,
        *,
        token_counter: TokenCounter | None = None,
        hint_extractor: HintExtractor | None = None,
        durability: Durability = "normal",
        artifact_threshold: int = 16 * 1024,
        max_event_bytes: int = 1024 * 1024,
        readers: int = 4,
        writers: int = 1,
        max_batch: int = 2048,
    ) -> None:
        if durability not in ("normal", "full"):
            raise ConfigError("durability", f"must be 'normal' or 'full', got {durability!r}")
        if type(readers) is not int or readers < 1:
            raise ConfigError("readers", "at least one reader connection is needed")
        if type(writers) is not int or writers < 1:
            raise ConfigError("writers", "at least one writer connection is needed")
        if type(max_batch) is not int or max_batch < 1:
            raise ConfigError("max_batch", "must be at least 1")
        self.dsn = dsn
        self.durability: Durability = durability
        self._policy = AppendPolicy(
            token_counter=token_counter,
            hint_extractor=hint_extractor,
            artifact_threshold=artifact_threshold,
            max_event_bytes=max_event_bytes,
        )
        self._reader_count = readers
        self._writer_count = writers
        self._max_batch = max_batch
        self._writer: GroupCommitWriter | None = None
        self._writer_conns: list[asyncpg.Connection] = []
        self._pool: asyncpg.Pool | None = None
        self._log = log.bind(store=_redact(dsn))

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
        if self._writer is not None or self._writer_conns:
            raise StoreError("the store is already open")
        try:
            first = await self._connect_writer()
            version = await migrate(first)
            for _ in range(self._writer_count - 1):
                await self._connect_writer()
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self._reader_count,
                server_settings={"application_name": "torpor-reader"},
            )
        except _DRIVER_ERRORS as exc:
            await self._close_connections()
            raise store_error(exc, f"cannot open the PostgreSQL store {_redact(self.dsn)}") from exc
        except BaseException:
            await self._close_connections()
            raise
        self._writer = GroupCommitWriter(
            self._writer_conns, self._reconnect_writer, max_batch=self._max_batch
        )
        self._writer.start()
        self._log.info("store_opened", schema_version=version, durability=self.durability)

    async def _connect(self) -> asyncpg.Connection:
        settings = {"application_name": "torpor-writer"}
        if self.durability == "full":
            settings["synchronous_commit"] = "on"
        return await asyncpg.connect(self.dsn, server_settings=settings)

    async def _connect_writer(self) -> asyncpg.Connection:
        conn = await self._connect()
        self._writer_conns.append(conn)
        return conn

    async def _reconnect_writer(self) -> asyncpg.Connection:
        return await self._connect()

    async def close(self) -> None:
        try:
            if self._writer is not None:
                await self._writer.aclose()
        finally:
            self._writer = None
            await self._close_connections()
            self._log.info("store_closed")

    async def _close_connections(self) -> None:
        conns, self._writer_conns = self._writer_conns, []
        pool, self._pool = self._pool, None
        for conn in conns:
            if not conn.is_closed():
                try:
                    await conn.close(timeout=10)
                except Exception:  # a broken connection: drop it
                    conn.terminate()
        if pool is not None:
            try:
                await pool.close()
            except Exception:
                pool.terminate()

    def _write(self) -> GroupCommitWriter:
        if self._writer is None:
            raise StoreError("the store is not open")
        return self._writer

    async def _read(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a read on the pool; a read that lost its connection is tried once more.

        Reads change nothing, so repeating one is safe, and a pooled connection
        the server closed (a restart, ``pg_terminate_backend``) is only found out
        when it is used; then every pooled connection is replaced (the others
        were most likely closed too) and the retry gets a fresh one.
        """
        for attempt in (1, 2):
            pool = self._pool
            if pool is None:
                raise StoreError("the store is not open")
            try:
                return await fn(pool, *args)
            except Exception as exc:
                if not isinstance(exc, _DRIVER_ERRORS):
                    raise
                if attempt == 1 and is_unavailable(exc):
                    await pool.expire_connections()
                    continue
                raise store_error(exc, "read failed") from exc
        raise AssertionError("unreachable")

    # writes ----------------------------------------------------------------------

    def _prepare(
        self,
        conversation_id: str,
        events: Sequence[Body],
        turn: int,
        expect_head: int | None,
        key: str | None,
    ) -> PreparedAppend:
        return self._policy.prepare(
            conversation_id, events, turn=turn, expect_head=expect_head, key=key
        )

    async def append(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
    ) -> list[int]:
        prepared = self._prepare(conversation_id, events, turn, expect_head, key)
        return cast(list[int], await self._write().submit(AppendOp.build(prepared)))

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
        prepared = self._prepare(conversation_id, events, turn, expect_head, key)
        op = AppendOp.build(prepared, with_events=True)
        return cast(list[Event], await self._write().submit(op))

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._write().submit(CheckpointOp(check_checkpoint(checkpoint)))

    async def put_artifact(self, conversation_id: str, data: bytes) -> str:
        _check_id(conversation_id)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput("data", "artifact data must be bytes")
        raw = bytes(data)
        op = ArtifactOp(conversation_id, new_artifact_id(), len(raw), compress_artifact(raw))
        return cast(str, await self._write().submit(op))

    async def record_model_call(self, call: ModelCall) -> None:
        """Store one audit row; a ``created_at`` of 0 is stamped with the current time."""
        call = admit_model_call(call)
        if not call.created_at:
            call = msgspec.structs.replace(call, created_at=now_ms())
        await self._write().submit(ModelCallOp(call))

    # reads -----------------------------------------------------------------------

    async def head(self, conversation_id: str) -> int | None:
        return await self._read(reads.head, _check_id(conversation_id))

    async def read_since(self, conversation_id: str, position: int) -> list[Event]:
        _check_id(conversation_id)
        check_position(position)
        return await self._read(reads.read_since, conversation_id, position)

    async def read_range(self, conversation_id: str, start: int, end: int) -> list[Event]:
        _check_id(conversation_id)
        check_position(start, "start")
        check_position(end, "end")
        return await self._read(reads.read_range, conversation_id, start, end)

    async def page_backward(
        self, conversation_id: str, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        _check_id(conversation_id)
        if before is not None:
            check_position(before, "before")
        check_limit(limit)
        return await self._read(reads.page_backward, conversation_id, before, limit)

    async def resume(self, conversation_id: str) -> Resume:
        """Latest checkpoint, head and every event since: one statement, one snapshot."""
        return await self._read(reads.resume, _check_id(conversation_id))

    async def latest_checkpoint(self, conversation_id: str) -> Checkpoint | None:
        return await self._read(reads.latest_checkpoint, _check_id(conversation_id))

    async def checkpoints(self, conversation_id: str) -> list[Checkpoint]:
        return await self._read(reads.checkpoints, _check_id(conversation_id))

    async def search(self, conversation_id: str, query: str, k: int = 10) -> list[SearchHit]:
        """ts_rank-scored events of one conversation; see :mod:`.lexemes` for the matching."""
        _check_id(conversation_id)
        check_limit(k, "k")
        return await self._read(reads.search, conversation_id, search_query(query), k)

    async def get_artifact(self, artifact_id: str) -> bytes:
        """The full bytes of an artifact; UnknownArtifact (a KeyError) if there is none."""
        return await self._read(reads.get_artifact, check_id(artifact_id, "artifact_id"))

    async def model_calls(
        self, conversation_id: str, *, turn: int | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """The most recent ``limit`` calls (of ``turn`` if given), oldest first."""
        _check_id(conversation_id)
        if turn is not None:
            check_turn(turn)
        check_limit(limit)
        return await self._read(reads.model_calls, conversation_id, turn, limit)

    async def conversations(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[ConversationInfo]:
        """Conversations ordered by id (bytewise), those after ``after`` (keyset pagination)."""
        check_after(after)
        check_limit(limit)
        return await self._read(reads.conversations, after, limit)

    async def conversation(self, conversation_id: str) -> ConversationInfo | None:
        return await self._read(reads.conversation, _check_id(conversation_id))

    async def pending(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[PendingApproval]:
        """Conversations waiting on outside answers, by id (bytewise), after ``after``."""
        check_after(after)
        check_limit(limit)
        return await self._read(reads.pending, after, limit)


def _redact(dsn: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = dsn.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return dsn
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
