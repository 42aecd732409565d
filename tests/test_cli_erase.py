"""``torpor purge`` and ``torpor delete`` in a subprocess on a SQLite file (cli.erase)."""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

import pytest
from test_cli import db_url, torpor

from torpor import Runtime
from torpor.cli.erase import duration
from torpor.events import UserMessage
from torpor.store import open_store

DAY_MS = 86_400_000


async def _conversations(db: str) -> list[str]:
    async with open_store(db) as store:
        return sorted(i.id for i in await store.list_conversations(limit=1000))


async def _fill(path: Path, names: list[str], old: list[str]) -> str:
    db = db_url(path)
    async with Runtime(db) as rt:
        for name in names:
            await rt.store.append(name, [UserMessage(f"hello {name}")])
    with sqlite3.connect(path) as conn:
        for name in old:
            conn.execute("UPDATE conversations SET updated_at = updated_at - ? "
                         "WHERE external_id = ?", (31 * DAY_MS, name))
    return db


def test_durations() -> None:
    assert [duration(t) for t in ("30d", "12h", "90m", "3600s", "42")] == [
        30 * 86400, 12 * 3600, 90 * 60, 3600, 42]
    for bad in ("", "1w", "-1d", "1.5h", "d"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


async def test_purge_deletes_only_conversations_idle_that_long(tmp_path: Path) -> None:
    db = await _fill(tmp_path / "p.db", ["a", "b", "c"], old=["a", "c"])
    result = torpor("purge", "--db", db, "--older-than", "30d")
    assert (result.returncode, result.stdout.strip()) == (0, "deleted 2 conversations"), \
        result.stderr
    assert await _conversations(db) == ["b"]
    async with open_store(db) as store:
        assert sorted((d.conversations, d.by) for d in await store.deletions()) == [
            (("a",), "retention"), (("c",), "retention")]
    assert torpor("purge", "--db", db, "--older-than", "30d").stdout.strip() == \
        "deleted 0 conversations"
    bad = torpor("purge", "--db", db, "--older-than", "soon")
    assert bad.returncode == 2 and "duration" in bad.stderr


async def test_delete_named_conversations_and_a_prefix_with_yes(tmp_path: Path) -> None:
    names = ["u1:a", "u1:b", "u1:c", "u2:a", "solo", "other"]
    db = await _fill(tmp_path / "d.db", names, old=[])
    result = torpor("delete", "--db", db, "solo", "missing")
    assert result.returncode == 2
    assert result.stdout.strip() == "deleted 1 conversation"
    assert result.stderr.strip() == "torpor: error: unknown conversation: missing"
    refused = torpor("delete", "--db", db, "--prefix", "u1:")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert await _conversations(db) == ["other", "u1:a", "u1:b", "u1:c", "u2:a"]
    done = torpor("delete", "--db", db, "--prefix", "u1:", "--yes")
    assert (done.returncode, done.stdout.strip()) == (0, "deleted 3 conversations")
    assert await _conversations(db) == ["other", "u2:a"]
    assert torpor("delete", "--db", db).returncode == 2  # nothing named


async def test_a_clusters_database_is_refused_in_one_line(pg_url: str) -> None:
    """A store without a node's fence writes nothing on a cluster's database: the CLI
    says so up front (not a FencedError about joining as a node), and deletes nothing."""
    from torpor import NodeConfig
    from torpor.store.postgres import PostgresStore

    node = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=5.0, shards=4)
    async with Runtime(pg_url, node=node) as rt:
        await rt.store.append("c", [UserMessage("hello")])
    for args in (("delete", "--db", pg_url, "c"), ("purge", "--db", pg_url, "--older-than", "0")):
        result = torpor(*args)
        assert result.returncode == 2, result.stderr
        assert "is a cluster's database" in result.stderr
        assert "DELETE /v1/conversations/" in result.stderr
    async with PostgresStore(pg_url) as store:
        assert await store.head("c") == 0
        assert await store.deletions() == []
