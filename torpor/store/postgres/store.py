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
from torpor.errors import ConfigError, StoreError
from torpor.events import Body, Event
from torpor.store.postgres import reads
from torpor.store.postgres.plan import AppendOp, ArtifactOp, CheckpointOp, ModelCallOp
from torpor.store.postgres.schema import migrate
from torpor.store.postgres.writer import GroupCommitWriter
from torpor.store.prepare import (
    AppendPolicy,
    PreparedAppend,
    check_conversation_id,
    new_artifact_id,
    now_ms,
)
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    ModelCall,
    Resume,
    SearchHit,
    TokenCounter,
)
from torpor.store.rows import compress_artifact
from torpor.store.sqlite.schema import Durability

__all__ = ["PostgresStore"]

log = get_logger(__name__)

T = TypeVar("T")


def _check_id(conversation_id: str) -> str:
    check_conversation_id(conversation_id)
    if "\x00" in conversation_id:
        raise ValueError("conversation id must not contain NUL (PostgreSQL text cannot hold it)")
    return conversation_id


def _check_limit(limit: int) -> None:
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")


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
        durability: Durability = "normal",
        artifact_threshold: int = 16 * 1024,
        max_event_bytes: int = 1024 * 1024,
        readers: int = 4,
        writers: int = 1,
        max_batch: int = 2048,
    ) -> None:
        if durability not in ("normal", "full"):
            raise ConfigError("durability", f"must be 'normal' or 'full', got {durability!r}")
        if readers < 1:
            raise ConfigError("readers", "at least one reader connection is needed")
        if writers < 1:
            raise ConfigError("writers", "at least one writer connection is needed")
        if max_batch < 1:
            raise ConfigError("max_batch", "must be at least 1")
        self.dsn = dsn
        self.durability: Durability = durability
        self._policy = AppendPolicy(
            token_counter=token_counter,
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
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await self._close_connections()
            raise StoreError(
                f"cannot open the PostgreSQL store {_redact(self.dsn)}: {exc}"
            ) from exc
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
        if self._pool is None:
            raise StoreError("the store is not open")
        try:
            return await fn(self._pool, *args)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise StoreError(f"read failed: {exc!r}") from exc

    # writes ----------------------------------------------------------------------

    def _prepare(
        self,
        conversation_id: str,
        events: Sequence[Body],
        turn: int,
        expect_head: int | None,
        key: str | None,
    ) -> PreparedAppend:
        prepared = self._policy.prepare(
            conversation_id, events, turn=turn, expect_head=expect_head, key=key
        )
        _check_id(conversation_id)
        if key is not None and "\x00" in key:
            raise ValueError("idempotency key must not contain NUL")
        return prepared

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
        _check_id(checkpoint.conversation_id)
        await self._write().submit(CheckpointOp(checkpoint))

    async def put_artifact(self, conversation_id: str, data: bytes) -> str:
        _check_id(conversation_id)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("artifact data must be bytes")
        raw = bytes(data)
        op = ArtifactOp(conversation_id, new_artifact_id(), len(raw), compress_artifact(raw))
        return cast(str, await self._write().submit(op))

    async def record_model_call(self, call: ModelCall) -> None:
        """Store one audit row; a ``created_at`` of 0 is stamped with the current time."""
        _check_id(call.conversation_id)
        if not call.created_at:
            call = msgspec.structs.replace(call, created_at=now_ms())
        await self._write().submit(ModelCallOp(call))

    # reads -----------------------------------------------------------------------

    async def head(self, conversation_id: str) -> int | None:
        return await self._read(reads.head, _check_id(conversation_id))

    async def read_since(self, conversation_id: str, position: int) -> list[Event]:
        return await self._read(reads.read_since, _check_id(conversation_id), position)

    async def read_range(self, conversation_id: str, start: int, end: int) -> list[Event]:
        return await self._read(reads.read_range, _check_id(conversation_id), start, end)

    async def page_backward(
        self, conversation_id: str, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        _check_limit(limit)
        return await self._read(reads.page_backward, _check_id(conversation_id), before, limit)

    async def resume(self, conversation_id: str) -> Resume:
        """Latest checkpoint, head and every event since: one statement, one snapshot."""
        return await self._read(reads.resume, _check_id(conversation_id))

    async def latest_checkpoint(self, conversation_id: str) -> Checkpoint | None:
        return await self._read(reads.latest_checkpoint, _check_id(conversation_id))

    async def checkpoints(self, conversation_id: str) -> list[Checkpoint]:
        return await self._read(reads.checkpoints, _check_id(conversation_id))

    async def search(self, conversation_id: str, query: str, k: int = 10) -> list[SearchHit]:
        """ts_rank-scored events of one conversation; see :mod:`.lexemes` for the matching."""
        _check_limit(k)
        return await self._read(reads.search, _check_id(conversation_id), query, k)

    async def get_artifact(self, artifact_id: str) -> bytes:
        """The full bytes of an artifact; KeyError if there is none by that id."""
        if not isinstance(artifact_id, str) or "\x00" in artifact_id:
            raise KeyError(f"no artifact {artifact_id!r}")
        return await self._read(reads.get_artifact, artifact_id)

    async def model_calls(
        self, conversation_id: str, *, turn: int | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """The most recent ``limit`` calls (of ``turn`` if given), oldest first."""
        _check_limit(limit)
        return await self._read(reads.model_calls, _check_id(conversation_id), turn, limit)

    async def conversations(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[ConversationInfo]:
        """Conversations ordered by id (bytewise), those after ``after`` (keyset pagination)."""
        _check_limit(limit)
        return await self._read(reads.conversations, after, limit)

    async def conversation(self, conversation_id: str) -> ConversationInfo | None:
        return await self._read(reads.conversation, _check_id(conversation_id))


def _redact(dsn: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = dsn.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return dsn
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
