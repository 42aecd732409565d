"""Issue 8, item 6: a store that cannot write says so, writes nothing, and recovers by itself.

Real conditions, no mocks: SQLite hitting ``max_page_count`` (SQLITE_FULL),
a tiny tmpfs filling up, another connection holding the write lock past the
busy timeout (SQLITE_BUSY), the database file made immutable with
``chattr +i`` (refused even to root, unlike ``chmod``: see ``immutable``);
PostgreSQL with a read-only database, a backend terminated mid-batch, and
the disk-full SQLSTATE raised by the server. In each case every caller of the
batch gets StoreUnavailable, nothing of the batch is in the log, reads go on,
and the next write after the condition clears succeeds on the same store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
from pg_cluster import PgCluster
from store_backends import Backend

from torpor import StoreError, StoreUnavailable
from torpor.events import Suspended, UserMessage
from torpor.store import EventStore, ModelCall, SQLiteStore

BIG = "words that take room " * 1000  # ~20 KB: each append needs new pages


async def reads_still_work(store: EventStore, conversation: str, head: int) -> None:
    """Everything a runtime reads while writes fail: history, revival, recall, admin."""
    assert [e.position for e in await store.read_since(conversation, 0)] == list(range(head + 1))
    assert len(await store.page_backward(conversation)) == head + 1
    assert (await store.resume(conversation)).head == head
    assert await store.search(conversation, "before") != []
    assert await store.model_calls(conversation) != []
    assert await store.conversation(conversation) is not None
    assert await store.conversations() != []
    assert [p.conversation_id for p in await store.pending()] == [conversation]


async def seed(store: EventStore, conversation: str = "c") -> int:
    """A conversation with a pending call and an audit row; returns its head."""
    await store.append(conversation, [UserMessage("before the trouble")])
    await store.append(conversation, [Suspended(("call-1",), "", ("approve",))])
    await store.record_model_call(
        ModelCall(conversation, 1, 0, 0, b"", "h", {"tail": 1}, 10, 0.1)
    )
    return 1


async def fail_together(store: EventStore, conversation: str) -> list[BaseException]:
    """One group-commit batch of appends to new and existing conversations; their errors."""
    outcomes = await asyncio.gather(
        *(store.append(f"new-{i}", [UserMessage(BIG)]) for i in range(8)),
        store.append(conversation, [UserMessage(BIG)]),
        store.append_events(conversation, [UserMessage("small")], key="retry-me"),
        return_exceptions=True,
    )
    assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
    return [o for o in outcomes if isinstance(o, BaseException)]


async def nothing_was_written(store: EventStore, conversation: str, head: int) -> None:
    assert await store.head(conversation) == head
    assert [c.conversation_id for c in await store.conversations()] == [conversation]


# -- SQLite --------------------------------------------------------------------------------


def _page_count(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA page_count").fetchone()[0])


def _max_page_count(conn: sqlite3.Connection, pages: int) -> int:
    return int(conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0])


async def test_sqlite_full_database_then_recovers(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "log.db")) as store:
        head = await seed(store)
        pages = await store._on_writer(_page_count)
        assert await store._on_writer(_max_page_count, pages) == pages  # no room to grow
        errors = await fail_together(store, "c")
        assert "SQLITE_FULL" in str(errors[0])
        await nothing_was_written(store, "c", head)
        await reads_still_work(store, "c", head)
        with pytest.raises(StoreUnavailable):  # still full: still refused, still typed
            await store.append("c", [UserMessage(BIG)])
        await store._on_writer(_max_page_count, 1 << 30)  # room again: no reopen needed
        assert await store.append("c", [UserMessage(BIG)]) == [head + 1]
        (retried,) = await store.append_events("c", [UserMessage("small")], key="retry-me")
        assert retried.position == head + 2
        assert len(await store.conversations()) == 1


async def test_sqlite_locked_past_the_busy_timeout_then_recovers(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), busy_timeout=0.05) as store:
        head = await seed(store)
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            errors = await fail_together(store, "c")
            assert "SQLITE_BUSY" in str(errors[0])
            await reads_still_work(store, "c", head)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


async def test_sqlite_file_turning_read_only_then_writable_again(
    tmp_path: Path, immutable: Any
) -> None:
    path = tmp_path / "log.db"
    files = [path, tmp_path / "log.db-wal"]  # not -shm: it is mapped into memory
    async with SQLiteStore(str(path)) as store:
        head = await seed(store)
        immutable(files, True)
        await fail_together(store, "c")  # SQLITE_IOERR: the kernel refuses the write
        await nothing_was_written(store, "c", head)
        await reads_still_work(store, "c", head)
        with pytest.raises(StoreUnavailable):  # the writer reconnected: still read-only
            await store.append("c", [UserMessage("still not")])
        immutable(files, False)
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


async def test_sqlite_store_opened_on_a_read_only_file_recovers(
    tmp_path: Path, immutable: Any
) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        head = await seed(store)
    immutable([path], True)
    async with SQLiteStore(str(path)) as store:  # its writer connection opens read-only
        await reads_still_work(store, "c", head)
        with pytest.raises(StoreUnavailable, match="readonly"):
            await store.append("c", [UserMessage("refused")])
        immutable([path], False)
        # a connection opened read-only stays so: the writer replaced it by itself
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


async def test_sqlite_on_a_filesystem_that_fills_up(tiny_filesystem: Path) -> None:
    filler = tiny_filesystem / "filler"
    async with SQLiteStore(str(tiny_filesystem / "log.db")) as store:
        head = await seed(store)
        with contextlib.suppress(OSError), filler.open("wb") as out:  # take what is left
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        with pytest.raises(StoreUnavailable, match="SQLITE_FULL"):
            for _ in range(100):  # whatever room the database file still had runs out
                await store.append("c", [UserMessage(BIG)])
                head += 1
        await reads_still_work(store, "c", head)
        filler.unlink()  # space freed: the same store writes again
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


# -- PostgreSQL ----------------------------------------------------------------------------

postgres = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


async def admin_sql(url: str, statement: str, *args: Any) -> Any:
    import asyncpg

    conn = await asyncpg.connect(url.split("?", 1)[0])
    try:
        return await conn.fetch(statement, *args)
    finally:
        await conn.close()


_TERMINATE_WRITERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND application_name = 'torpor-writer'"
)


@postgres
async def test_postgres_disk_full_fails_the_whole_batch_then_recovers(backend: Backend) -> None:
    async with backend.open() as store:
        head = await seed(store)
        await backend.sql(
            "CREATE FUNCTION no_space() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING ERRCODE = 'disk_full'; END $$"
        )
        await backend.sql(
            "CREATE TRIGGER no_space BEFORE INSERT ON events "
            "FOR EACH STATEMENT EXECUTE FUNCTION no_space()"
        )
        errors = await fail_together(store, "c")
        assert "53100" in str(errors[0])
        await nothing_was_written(store, "c", head)
        await reads_still_work(store, "c", head)
        await backend.sql("DROP TRIGGER no_space ON events")
        assert await store.append("c", [UserMessage("after")]) == [head + 1]
        assert await store.append("new-0", [UserMessage("after")]) == [0]


async def test_postgres_read_only_database_then_writable_again(pg_cluster: PgCluster) -> None:
    # A database of its own: it is made read-only as a whole.
    database = "ro_" + uuid.uuid4().hex[:12]
    await admin_sql(pg_cluster.url(), f'CREATE DATABASE "{database}"')
    backend = Backend("postgres", pg_cluster.url(database))
    read_only = f'ALTER DATABASE "{database}" SET default_transaction_read_only = on'
    async with backend.open() as store:
        head = await seed(store)
        await admin_sql(pg_cluster.url(), read_only)
        try:
            await admin_sql(backend.location, _TERMINATE_WRITERS)  # new sessions: read-only
            with pytest.raises(StoreUnavailable):
                await store.append("c", [UserMessage("refused")])
            errors = await fail_together(store, "c")  # a fresh session, read-only (25006)
            assert "25006" in str(errors[0])
            await nothing_was_written(store, "c", head)
            await reads_still_work(store, "c", head)
        finally:
            await admin_sql(pg_cluster.url(), read_only.replace("SET", "RESET").split(" =")[0])
        # the writer left its read-only session behind; the next one can write
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


@postgres
async def test_postgres_writer_terminated_mid_batch_then_recovers(backend: Backend) -> None:
    import asyncpg

    async with backend.open() as store:
        head = await seed(store)
        holder = await asyncpg.connect(
            backend.location.split("?", 1)[0],
            server_settings={"search_path": backend.location.rsplit("=", 1)[1]},
        )
        admin = await asyncpg.connect(backend.location.split("?", 1)[0])
        try:
            locked = holder.transaction()
            await locked.start()
            await holder.execute("SELECT 1 FROM conversations WHERE external_id = 'c' FOR UPDATE")
            batch = asyncio.ensure_future(fail_together(store, "c"))
            async with asyncio.timeout(10):  # the batch is stuck in its transaction
                while not await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'torpor-writer' AND wait_event_type = 'Lock'"
                ):
                    pass
            await admin.execute(_TERMINATE_WRITERS)
            await locked.rollback()
            await batch
        finally:
            await holder.close()
            await admin.close()
        await nothing_was_written(store, "c", head)
        await reads_still_work(store, "c", head)
        assert await store.append("c", [UserMessage("after")]) == [head + 1]


async def test_unavailable_is_a_store_error() -> None:
    assert issubclass(StoreUnavailable, StoreError)
