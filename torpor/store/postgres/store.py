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

Scale-out (``fence=``, given by :mod:`torpor.cluster`): every append carries
the shard and lease epoch the node holds (see :mod:`.batch`), and every
connection sets ``idle_in_transaction_session_timeout`` and TCP keepalives,
so a node stopped (SIGSTOP) or cut off inside a transaction loses its locks
on lease rows instead of blocking a takeover until it resumes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from torpor._logging import get_logger
from torpor.errors import ConfigError, FencedError, StoreError
from torpor.store.core import StoreCore
from torpor.store.fence import Fence, shard_of
from torpor.store.listing import Deletion
from torpor.store.memory import MemoryRecord
from torpor.store.memory_rows import MemoryWrite
from torpor.store.postgres import reads
from torpor.store.postgres.delete import delete_tree, describe
from torpor.store.postgres.errors import DRIVER_ERRORS, is_unavailable, store_error
from torpor.store.postgres.memory_ops import read_memory, write_memory
from torpor.store.postgres.plan import AppendOp, ArtifactOp, CheckpointOp, ModelCallOp
from torpor.store.postgres.redact import redact_event
from torpor.store.postgres.schedule_ops import add_schedule, remove_schedule
from torpor.store.postgres.schema import migrate
from torpor.store.postgres.writer import GroupCommitWriter
from torpor.store.prepare import PreparedAppend, now_ms
from torpor.store.protocol import (
    Checkpoint,
    HintExtractor,
    ModelCall,
    SearchHit,
    TokenCounter,
)
from torpor.store.rows import compress_artifact
from torpor.store.schedules import NewSchedule, Schedule
from torpor.store.sqlite.schema import Durability

__all__ = ["PostgresStore", "node_session_settings"]

log = get_logger(__name__)

T = TypeVar("T")



_CLUSTER = "SELECT shards FROM cluster"


class PostgresStore(StoreCore):
    """An :class:`~torpor.store.protocol.EventStore` over one PostgreSQL database.

    Use as an async context manager (or through :func:`torpor.store.open_store`
    with a ``postgresql://`` or ``postgres://`` URL): entering connects,
    migrates the schema and starts the writers; leaving commits whatever is
    queued, stops the writers and closes every connection.
    """

    reads = reads

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
        fence: Fence | None = None,
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
        if type(writers) is not int or writers < 1:
            raise ConfigError("writers", "at least one writer connection is needed")
        self.dsn = dsn
        self._fence = fence
        self._cluster_shards: int | None = None  # set: a cluster runs here, no fence given
        self._writer_count = writers
        self._writer: GroupCommitWriter | None = None
        self._writer_conns: list[asyncpg.Connection] = []
        self._pool: asyncpg.Pool | None = None
        self._log = log.bind(store=_redact(dsn))

    @property
    def read_only(self) -> bool:
        return self._cluster_shards is not None

    # lifecycle -------------------------------------------------------------------

    async def open(self) -> None:
        if self._writer is not None or self._writer_conns:
            raise StoreError("the store is already open")
        try:
            first = await self._connect_writer()
            version = await migrate(first)
            if self._fence is None:  # a cluster's database: read-only without a node's fence
                self._cluster_shards = await first.fetchval(_CLUSTER)
            for _ in range(self._writer_count - 1):
                await self._connect_writer()
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self._reader_count,
                server_settings=self._settings("torpor-reader"),
            )
        except DRIVER_ERRORS as exc:
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

    def _settings(self, name: str) -> dict[str, str]:
        settings = {"application_name": name}
        if self._fence is not None:
            settings.update(node_session_settings(self._fence.idle_timeout))
        return settings

    async def _connect(self) -> asyncpg.Connection:
        settings = self._settings("torpor-writer")
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
            await self._settle()  # appends still being prepared off the loop are queued first
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

    @property
    def unavailable_since(self) -> float | None:
        """``time.monotonic()`` when writes started failing for want of a writable
        database (connection lost, read-only, disk full), None while the last write
        committed (or none failed): a hint that costs nothing, for a caller deciding
        whether to wait for the store. Writes themselves say so with StoreUnavailable."""
        writer = self._writer
        return None if writer is None else writer.unavailable_since

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
                if not isinstance(exc, DRIVER_ERRORS):
                    raise
                if attempt == 1 and is_unavailable(exc):
                    await pool.expire_connections()
                    continue
                raise store_error(exc, "read failed") from exc
        raise AssertionError("unreachable")

    # what StoreCore asks of a backend ----------------------------------------------

    async def _submit(self, op: Any) -> Any:
        try:
            return await self._write().submit(op)
        except FencedError as exc:
            self._refused(exc)
            raise

    def _refused(self, exc: FencedError) -> None:
        if self._fence is not None and exc.epoch is not None:
            self._fence.fenced(exc.shard, exc.epoch)

    async def _reading(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return await self._read(fn, *args)

    def _held(self, conversation_id: str) -> tuple[int, int] | None:
        """The (shard, epoch) a write of a clustered node presents (every write does).

        A store without a fence on a database where a cluster of nodes runs writes
        nothing: its writes would carry no epoch, so no takeover could stop them.
        """
        if self._fence is not None:
            return self._fence.hold(conversation_id)
        if self._cluster_shards is not None:
            raise FencedError(
                conversation_id, shard_of(conversation_id, self._cluster_shards), None,
                "this database serves a cluster of nodes; a store opened without node= "
                "may read but not write (join as a node: Runtime(url, node=NodeConfig(...)))",
            )
        return None

    def _append_op(
        self, prepared: PreparedAppend, with_events: bool, audit: ModelCall | None = None
    ) -> AppendOp:
        fence = self._held(prepared.conversation_id)
        return AppendOp.build(prepared, with_events=with_events, fence=fence, audit=audit)

    def _checkpoint_op(self, checkpoint: Checkpoint) -> CheckpointOp:
        return CheckpointOp(checkpoint, self._held(checkpoint.conversation_id))

    def _artifact_op(self, conversation_id: str, artifact_id: str, data: bytes) -> ArtifactOp:
        return ArtifactOp(conversation_id, artifact_id, len(data), compress_artifact(data),
                          self._held(conversation_id))

    def _model_call_op(self, call: ModelCall) -> ModelCallOp:
        return ModelCallOp(call, self._held(call.conversation_id))

    async def _write_memory(self, write: MemoryWrite) -> None:
        # Not retried like a read: a ledger insert twice would be two rows.
        pool = self._pool
        if pool is None:
            raise StoreError("the store is not open")
        fence = self._held(write.conversation_id)
        try:
            await write_memory(pool, write, fence)
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, "memory write failed") from exc

    async def _read_memory(self, conversation_id: str) -> MemoryRecord:
        return await self._read(read_memory, conversation_id)

    def _pool_now(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StoreError("the store is not open")
        return self._pool

    async def _describe(self, name: str, title: str | None, metadata: str | None) -> bool:
        pool = self._pool_now()
        try:
            return await describe(pool, name, title, metadata, self._held(name))
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, f"describe of {name!r} failed") from exc

    async def _add_schedule(self, new: NewSchedule, at_most: int | None) -> Schedule:
        pool = self._pool_now()
        try:
            return await add_schedule(pool, new, at_most, self._held(new.conversation_id))
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, f"schedule for {new.conversation_id!r} failed") from exc

    async def _remove_schedule(self, name: str, schedule_id: str) -> bool:
        pool = self._pool_now()
        try:
            return await remove_schedule(pool, name, schedule_id, self._held(name))
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, f"unschedule in {name!r} failed") from exc

    async def _delete(self, name: str, by: str) -> Deletion | None:
        """One transaction beside the group commit (see :mod:`.delete`), fenced on a node."""
        await self._settle()  # appends still being prepared off the loop land first
        pool = self._pool_now()
        self._held(name)  # a node that does not hold the shard (or no node) writes nothing
        try:
            deletion = await delete_tree(pool, name, by, now_ms(), self._held)
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, f"delete of {name!r} failed") from exc
        if deletion is not None:
            self._log.info(
                "conversation_deleted", conversation_id=name, by=by,
                conversations=len(deletion.conversations),
                events=deletion.rows.get("events", 0),
            )
        return deletion

    async def _redact(self, name: str, position: int, reason: str) -> Deletion | None:
        """One transaction beside the group commit (see :mod:`.redact`), fenced on a node."""
        await self._settle()
        pool = self._pool_now()
        fence = self._held(name)
        try:
            deletion = await redact_event(
                pool, name, position, reason, now_ms(), self._count_redacted, fence
            )
        except FencedError as exc:
            self._refused(exc)
            raise
        except DRIVER_ERRORS as exc:
            raise store_error(exc, f"redaction in {name!r} failed") from exc
        if deletion is not None:
            self._log.info("event_redacted", conversation_id=name, position=position)
        return deletion

    async def _search(
        self, conversation_id: str, query: str, k: int, exclude: frozenset[str]
    ) -> list[SearchHit]:
        """ts_rank-scored; see :mod:`.lexemes` for the matching."""
        return await self._read(reads.search, conversation_id, query, k, exclude)


def node_session_settings(idle_timeout: float) -> dict[str, str]:
    """Server settings of every connection a clustered node opens.

    ``idle_in_transaction_session_timeout``: a process stopped inside a
    transaction (SIGSTOP, a long GC pause) has its session ended, releasing its
    share locks on lease rows, so a takeover proceeds. TCP keepalives: the server
    notices a peer that vanished without closing its socket (power loss, a cut
    cable) within seconds instead of the kernel's two hours.
    """
    idle_ms = max(100, int(idle_timeout * 1000))
    return {
        "idle_in_transaction_session_timeout": str(idle_ms),
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "3",
    }


def _redact(dsn: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = dsn.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return dsn
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
