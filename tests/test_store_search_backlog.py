"""Issue 9, item 3: small commits leave full-text indexing for later, search never misses.

An FTS5 index writes a segment at every COMMIT that touched it; for a one-append
group commit that was half the transaction. Small batches put their rows in
``fts_backlog`` (same transaction) and the index takes them in bulk: when the
backlog grows, with a large batch, or when a search meets rows of its
conversation there.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from torpor.events import UserMessage
from torpor.store import SQLiteStore
from torpor.store.sqlite.batch import SearchBacklog


def counts(path: Path) -> tuple[int, int]:
    """(rows in the backlog, rows in the index), read from outside."""
    raw = sqlite3.connect(path)
    try:
        backlog = raw.execute("SELECT count(*) FROM fts_backlog").fetchone()[0]
        # every test body has "word" (a contentless FTS5 table cannot be scanned)
        indexed = raw.execute(
            "SELECT count(*) FROM events_fts WHERE events_fts MATCH 'word'"
        ).fetchone()[0]
        return int(backlog), int(indexed)
    finally:
        raw.close()


async def test_small_commits_wait_in_the_backlog_and_search_indexes_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        for i in range(5):
            await store.append("c", [UserMessage(f"word number {i}")])
        assert store._write().search_backlog == 5
        assert counts(path) == (5, 0)
        hits = await store.search("c", "number 3")
        assert hits[0].position == 3
        assert store._write().search_backlog == 0
        assert counts(path) == (0, 5)


async def test_a_search_of_another_conversation_leaves_the_backlog(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("a", [UserMessage("word in a")])
        await store.append("b", [UserMessage("word in b")])
        await store.search("b", "word")  # b's row is waiting: the whole backlog goes in
        assert counts(path) == (0, 2)
        await store.append("a", [UserMessage("another word in a")])
        assert [h.position for h in await store.search("b", "word")] == [0]
        assert counts(path) == (1, 2)  # nothing of b waited: no write for this search


async def test_large_batch_indexes_directly_and_takes_the_backlog_along(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("c", [UserMessage("word before")])
        assert counts(path) == (1, 0)
        await store.append("c", [UserMessage(f"word {i}") for i in range(64)])
        assert counts(path) == (0, 65)
        assert store._write().search_backlog == 0


def test_backlog_flushes_by_rows_and_by_bytes() -> None:
    raw = sqlite3.connect(":memory:", isolation_level=None)
    raw.execute("CREATE TABLE fts_backlog (rowid INTEGER PRIMARY KEY, text TEXT NOT NULL)")
    raw.execute("CREATE VIRTUAL TABLE events_fts USING fts5(text, content='')")
    backlog = SearchBacklog(flush_rows=4, flush_bytes=100, direct_rows=3, direct_bytes=60)
    assert backlog.write(raw, [(1, "a"), (2, "b")], False) == (2, 2)
    backlog.size = (2, 2)
    assert backlog.write(raw, [(3, "c"), (4, "d")], False) == (0, 0)  # 4 rows: indexed
    assert raw.execute("SELECT count(*) FROM fts_backlog").fetchone() == (0,)
    backlog.size = (0, 0)
    assert backlog.write(raw, [(5, "x" * 50)], False) == (1, 50)
    backlog.size = (1, 50)
    assert backlog.write(raw, [(6, "y" * 50)], False) == (0, 0)  # 100 bytes: indexed
    backlog.size = (0, 0)
    assert backlog.write(raw, [(7, "z" * 70)], False) == (0, 0)  # one big row: direct
    assert backlog.write(raw, [], True) == (0, 0)
    rows = raw.execute("SELECT rowid FROM events_fts WHERE events_fts MATCH 'c OR d'").fetchall()
    assert sorted(rows) == [(3,), (4,)]


async def test_backlog_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        for i in range(3):
            await store.append("c", [UserMessage(f"word kept {i}")])
    assert counts(path)[0] == 3
    async with SQLiteStore(str(path)) as store:
        assert store._write().search_backlog == 3
        assert (await store.search("c", "kept 2"))[0].position == 2


async def test_search_finds_waiting_rows_when_the_database_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), busy_timeout=0.05) as store:
        await store.append("c", [UserMessage("word indexed long ago")] * 64)  # direct
        await store.append("c", [UserMessage("the newest word, a needle")])  # waits
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # the backlog cannot be indexed now
            hits = await store.search("c", "needle")
            assert [h.position for h in hits] == [64]
            assert len(await store.search("c", "long ago", k=3)) == 3
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert store._write().search_backlog == 1
        assert [h.position for h in await store.search("c", "needle")] == [64]
        assert store._write().search_backlog == 0


async def test_the_store_indexes_its_backlog_every_2048_rows(tmp_path: Path) -> None:
    """The bulk insert that indexes the backlog makes its commit slow (it goes to the
    writer thread): every 2,048 rows, one turn in about 1,000 at one conversation."""
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        for i in range(2047):
            await store.append("c", [UserMessage(f"word {i}")])
        assert counts(path) == (2047, 0)
        await store.append("c", [UserMessage("word 2047")])
        assert counts(path) == (0, 2048)
        assert store._write().search_backlog == 0
