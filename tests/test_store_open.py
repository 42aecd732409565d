"""open_store URLs, schema versioning, durability settings, lifecycle."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_backends import AnyStore

from torpor import ConfigError, StoreError
from torpor.events import UserMessage
from torpor.store import SQLiteStore, UnsupportedStoreURL, open_store
from torpor.store.sqlite.schema import PAGE_SIZE, SCHEMA_VERSION


async def test_memory_urls_are_private_databases() -> None:
    async with open_store("sqlite://") as one, open_store("sqlite://") as two:
        await one.append("c", [UserMessage("only in one")])
        assert await one.head("c") == 0
        assert await two.head("c") is None


async def test_relative_and_absolute_file_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///rel.db") as store:
        await store.append("c", [UserMessage("relative")])
    assert (tmp_path / "rel.db").exists()
    absolute = tmp_path / "sub" / "abs.db"
    absolute.parent.mkdir()
    async with open_store(f"sqlite:///{absolute}") as store:
        await store.append("c", [UserMessage("absolute")])
    async with open_store(f"sqlite:///{absolute}") as store:
        assert [e.body for e in await store.read_since("c", 0)] == [UserMessage("absolute")]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mysql://db", "unknown scheme"),
        ("just-a-path.db", "no scheme"),
        ("sqlite:rel.db", "no scheme"),
        ("sqlite://host/rel.db", "expected sqlite:///"),
    ],
)
async def test_unsupported_urls_fail_clearly(url: str, words: str) -> None:
    with pytest.raises(UnsupportedStoreURL, match=words) as caught:
        async with open_store(url):
            pass
    assert isinstance(caught.value, StoreError) and isinstance(caught.value, ValueError)


async def test_schema_is_versioned_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("c", [UserMessage("kept")])
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    columns = {row[1] for row in raw.execute("PRAGMA table_info(events)")}
    assert {"conversation_id", "position", "kind", "turn", "tokens", "created_at", "body"} <= (
        columns
    )
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    with pytest.raises(StoreError, match="newer"):
        async with SQLiteStore(str(path)):
            pass


async def test_durability_levels(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "full.db"), durability="full") as store:
        assert await store.append("c", [UserMessage("synced")]) == [0]
    with pytest.raises(ConfigError):
        SQLiteStore(None, durability="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SQLiteStore(None, artifact_threshold=10)


async def test_a_closed_store_refuses_work(store: AnyStore) -> None:
    await store.close()
    with pytest.raises(StoreError):
        await store.append("c", [UserMessage("late")])
    with pytest.raises(StoreError):
        await store.read_since("c", 0)


async def test_a_new_database_has_small_pages_and_an_old_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    """WAL bytes per commit follow the page size (whole pages are written): a database
    the store creates uses 1 KiB pages; one made with 4 KiB pages opens and works as is."""
    new, old = tmp_path / "new.db", tmp_path / "old.db"
    with sqlite3.connect(old) as raw:
        raw.execute("PRAGMA page_size = 4096")
        raw.execute("PRAGMA journal_mode = WAL")
    for path in (new, old):
        async with SQLiteStore(str(path)) as store:
            await store.append("c", [UserMessage("hello " * 400)])
            assert len(await store.read_since("c", 0)) == 1
            assert [h.position for h in await store.search("c", "hello")] == [0]
    for path, size in ((new, PAGE_SIZE), (old, 4096)):
        with sqlite3.connect(path) as raw:
            assert raw.execute("PRAGMA page_size").fetchone()[0] == size
    assert PAGE_SIZE == 1024
