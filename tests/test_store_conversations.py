"""The conversations index and the audited delete, on every backend (store.listing, erase).

Listing: newest activity first, paged by cursor, by id prefix, with the default title
(the first user message) and the host's title and metadata. Delete: every row of every
table that names the conversation (tables found in the schema, so a new one cannot be
forgotten), its sub-agent conversations with it, one audit row, False-y for an unknown
conversation. On SQLite the deleted text is in no file of the store afterwards.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from store_backends import AnyStore, Backend

from torpor.errors import InvalidInput
from torpor.events import AssistantMessage, Spawned, Suspended, ToolCall, ToolResult, UserMessage
from torpor.store import SQLiteStore
from torpor.store.erase import KEYED_TABLES
from torpor.store.listing import TITLE_CHARS
from torpor.store.memory import EpisodicItem, LedgerEntry, SemanticItem
from torpor.store.protocol import Checkpoint, ModelCall
from torpor.store.schedules import check_new
from torpor.store.vectors import vector_index

SECRET = "zqxsecretwombat7731"


async def test_pages_newest_activity_first_by_cursor(backend: Backend) -> None:
    async with backend.open() as store:
        for index in range(7):
            await store.append(f"c{index}", [UserMessage(f"hello {index}")])
        await store.append("c2", [UserMessage("again")])
        # Activity times set behind the store's back (appends within one millisecond tie):
        # c3 and c5 tie, broken by the newer conversation first.
        when = {"c0": 50, "c1": 10, "c2": 90, "c3": 40, "c4": 20, "c5": 40, "c6": 30}
        for name, at in when.items():
            await backend.sql("UPDATE conversations SET updated_at = ? WHERE external_id = ?",
                              at, name)
        seen: list[str] = []
        after = None
        while True:
            page = await store.list_conversations(after=after, limit=3)
            assert len(page) <= 3
            seen += [info.id for info in page]
            if page.next is None:
                break
            after = page.next
        assert seen == ["c2", "c0", "c5", "c3", "c6", "c4", "c1"]
        first = (await store.list_conversations(limit=1)).items[0]
        shown = (first.id, first.events, first.title, first.last_activity)
        assert shown == ("c2", 2, "hello 2", 90)


async def test_prefix_lists_only_that_prefix(store: AnyStore) -> None:
    for name in ("alice/1", "alice/2", "alicex", "bob/1", "alic"):
        await store.append(name, [UserMessage("hi")])
    page = await store.list_conversations(prefix="alice/")
    assert sorted(i.id for i in page) == ["alice/1", "alice/2"]
    assert page.next is None
    one = await store.list_conversations(prefix="alice/", limit=1)
    rest = await store.list_conversations(prefix="alice/", after=one.next, limit=1)
    assert {one.items[0].id, rest.items[0].id} == {"alice/1", "alice/2"}
    assert [i.id for i in await store.list_conversations(prefix="zz")] == []


async def test_title_defaults_to_first_user_message_and_host_sets_it(store: AnyStore) -> None:
    await store.append("c", [Spawned("p", "call", "c", "a task")])  # no user message yet
    assert (await store.conversation("c")).title == ""  # type: ignore[union-attr]
    long = "word " * 100
    await store.append("c", [UserMessage(long)])
    await store.append("c", [UserMessage("second message")])
    info = await store.conversation("c")
    assert info is not None and info.title.startswith("word word")
    assert len(info.title) <= TITLE_CHARS
    assert await store.describe("c", title="Trip plans", metadata={"user": "u1", "n": 2})
    await store.append("c", [UserMessage("third")])
    info = await store.conversation("c")
    assert info is not None
    assert (info.title, info.metadata) == ("Trip plans", {"user": "u1", "n": 2})
    assert not await store.describe("unknown", title="x")
    assert await store.conversation("unknown") is None  # describing creates nothing
    with pytest.raises(InvalidInput):
        await store.describe("c", metadata={1: "x"})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput):
        await store.list_conversations(after="not a cursor")


async def _fill(store: AnyStore, name: str, *, secret: str = SECRET) -> None:
    """Rows of ``name`` in every table the store has."""
    await store.append(name, [UserMessage(f"my password is {secret}")], key=f"k-{name}")
    call = ToolCall("call-1", "fetch", {"url": "x"})
    await store.append(name, [AssistantMessage("", (call,))], turn=0)
    big = f"{secret} " + "lorem ipsum " * 20_000  # ~240 KB: an artifact
    await store.append(name, [ToolResult("call-1", "fetch", big)], turn=0)
    await store.append(name, [AssistantMessage(f"noted: {secret}")], turn=0)
    ask = ToolCall("call-2", "approve", {})
    await store.append(
        name, [AssistantMessage("", (ask,)), Suspended(("call-2",), "", ("approve",))], turn=1
    )
    await store.put_checkpoint(Checkpoint(name, 3, 1, 1, summary=f"the user said {secret}"))
    await store.record_model_call(ModelCall(name, 0, 0, 1, b"recipe", "h", {}, 10, 0.1,
                                            error=f"echo {secret}"))
    await store.put_memory(
        name,
        episodes=[EpisodicItem(3, 0, 2, (0,), f"talked about {secret}")],
        facts=[SemanticItem(3, 0, "password", "fact", f"password {secret}")],
    )
    await store.put_ledger(name, [LedgerEntry("password", "update", "fact:3:0")])
    await store.put_turn_decision(name, 0, "none")
    await vector_index(store).put(name, "space", [(0, [1.0, 0.0]), (3, [0.0, 1.0])], 3)
    await store.add_schedule(check_new(name, f"remind me of {secret}", at=None, after=60,
                                       every=None, key="daily", now=1))


async def _keyed_tables(backend: Backend) -> list[tuple[str, str]]:
    """Every (table, column) of the schema that names a conversation."""
    if backend.postgres:
        rows = await backend.sql(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() "
            "AND column_name IN ('conversation_id', 'conversation')"
        )
        return [(str(t), str(c)) for t, c in rows]
    found = []
    for (table,) in await backend.sql("SELECT name FROM sqlite_master WHERE type = 'table'"):
        for row in await backend.sql(f"PRAGMA table_info({table})"):
            if row[1] in ("conversation_id", "conversation"):
                found.append((str(table), str(row[1])))
    return found


async def _rows_of(backend: Backend, keys: dict[str, int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for table, column in await _keyed_tables(backend):
        if column == "conversation":
            values: list[Any] = list(keys)
        else:
            values = list(keys.values())
        marks = ", ".join("?" for _ in values)
        (count,), = await backend.sql(
            f"SELECT count(*) FROM {table} WHERE {column} IN ({marks})", *values
        )
        counts[table] = int(count)
    if not backend.postgres:  # the contentless index and its backlog: by rowid range
        # (A contentless index is read by MATCH only: the words every filled one holds.)
        where = {"events_fts": "events_fts MATCH 'lorem OR password OR noted' AND ",
                 "fts_backlog": ""}
        for table in ("events_fts", "fts_backlog"):
            total = 0
            for key in keys.values():
                (count,), = await backend.sql(
                    f"SELECT count(*) FROM {table} WHERE {where[table]}rowid BETWEEN ? AND ?",
                    key << 32, ((key + 1) << 32) - 1,
                )
                total += int(count)
            counts[table] = total
        found = 0
        for key in keys.values():
            (count,), = await backend.sql(
                "SELECT count(*) FROM events_fts WHERE events_fts MATCH ? "
                "AND rowid BETWEEN ? AND ?", SECRET, key << 32, ((key + 1) << 32) - 1,
            )
            found += int(count)
        counts["events_fts MATCH"] = found
    return counts


async def test_delete_removes_every_row_of_the_tree_and_audits(backend: Backend) -> None:
    async with backend.open() as store:
        await _fill(store, "p")
        await _fill(store, "other", secret="keepme")
        # A sub-agent, and its own sub-agent: deleted with the parent.
        await store.append("p/c1", [Spawned("p", "call-2", "p/c1", "task")])
        await store.append("p", [Spawned("p", "call-2", "p/c1")], turn=1)
        await _fill(store, "p/c1")
        await store.append("p/c1/g", [Spawned("p/c1", "x", "p/c1/g", "t"), UserMessage(SECRET)])
        await store.append("p/c1", [Spawned("p/c1", "x", "p/c1/g")], turn=1)
        await store.search("p", SECRET)  # indexes the backlog: entries in the index proper
        names = ("p", "p/c1", "p/c1/g")
        keys = {
            name: int(row[0])
            for name in names
            for row in await backend.sql("SELECT key FROM conversations WHERE external_id = ?",
                                         name)
        }
        before = await _rows_of(backend, keys)
        other = await _rows_of(backend, {"other": (await backend.sql(
            "SELECT key FROM conversations WHERE external_id = 'other'"))[0][0]})
        tables = {t for t, _ in await _keyed_tables(backend)}
        assert tables >= {*KEYED_TABLES, "pending_calls"}
        assert all(before[t] > 0 for t in KEYED_TABLES), before  # every table had rows
        assert before.get("events_fts", 1) > 0 and before.get("events_fts MATCH", 1) > 0

        deletion = await store.delete("p")

        assert deletion is not None
        assert deletion.conversations == names and deletion.by == "delete"
        assert deletion.rows["events"] == before["events"]
        assert deletion.rows["conversations"] == 3
        after = await _rows_of(backend, keys)
        assert all(count == 0 for count in after.values()), after
        assert await _rows_of(backend, {"other": (await backend.sql(
            "SELECT key FROM conversations WHERE external_id = 'other'"))[0][0]}) == other
        for name in names:
            assert await store.conversation(name) is None
            assert await store.search(name, SECRET) == []
            assert await store.page_backward(name) == []
        assert [d.conversations for d in await store.deletions()] == [names]
        rows = await backend.sql("SELECT by, conversations, rows FROM deletions")
        assert len(rows) == 1 and SECRET not in repr(rows)  # ids and counts, never content
        assert await store.delete("p") is None  # unknown now: nothing more recorded
        assert len(await store.deletions()) == 1
        assert [i.id for i in await store.list_conversations()] == ["other"]
        # The id may be used again: a new conversation, from position 0.
        assert await store.append("p", [UserMessage("fresh start")]) == [0]


async def test_bytes_gone_from_every_sqlite_file(tmp_path: Path) -> None:
    """A secret in a user message, a 240 KB tool result (artifact), a model answer, a
    fold's summary, memory items and an audit row: after the delete, in no file."""
    path = tmp_path / "store" / "log.db"
    path.parent.mkdir()
    async with SQLiteStore(str(path)) as store:
        await _fill(store, "c")
        await store.append("keep", [UserMessage("unrelated")])
        await store.search("c", SECRET)  # some entries in the index proper, some not
        await _fill(store, "c2")  # another with the secret, left in the backlog
        for name in ("c", "c2"):
            assert await store.delete(name) is not None
        files = {f.name: f.read_bytes() for f in path.parent.iterdir()}
        assert set(files) >= {"log.db", "log.db-wal"}
        # Every file, while the store is open (the WAL included), then once it closed.
        assert [n for n, data in files.items() if SECRET.encode() in data] == []
        assert await store.search("keep", "unrelated") != []
    for file in path.parent.iterdir():
        assert SECRET.encode() not in file.read_bytes(), file.name


async def test_delete_waits_for_appends_queued_before_it(store: AnyStore) -> None:
    """Appends queued before the delete land, then go with it; none lands half."""
    await store.append("c", [UserMessage("start")])
    appends = [asyncio.ensure_future(store.append("c", [UserMessage(f"m{i}")]))
               for i in range(20)]
    deletion = await store.delete("c")
    results = await asyncio.gather(*appends, return_exceptions=True)
    assert deletion is not None
    landed = [r for r in results if isinstance(r, list)]
    # Each append either went with the delete or started the id afresh, from position 0.
    head = await store.head("c")
    later = await store.page_backward("c", limit=100)
    assert deletion.rows["events"] + len(later) == 21
    assert head is None or head == len(later) - 1
    assert len(landed) == 20
    assert [e.position for e in reversed(later)] == list(range(len(later)))


async def test_a_child_id_taken_again_is_not_the_parents_to_delete(store: AnyStore) -> None:
    """A child deleted on its own frees its id; the new conversation that took it (its log
    no longer starts with the link back) stays when the old parent is deleted."""
    await store.append("p", [UserMessage("parent")])
    await store.append("p/c1", [Spawned("p", "call-1", "p/c1", "task")])
    await store.append("p", [Spawned("p", "call-1", "p/c1")], turn=1)
    assert await store.delete("p/c1") is not None  # the child alone
    await store.append("p/c1", [UserMessage("someone else's, under the freed id")])
    # And one the parent's log names that never was its child.
    await store.append("q", [UserMessage("never spawned by p")])
    await store.append("p", [Spawned("p", "call-2", "q")], turn=2)
    deletion = await store.delete("p")
    assert deletion is not None and deletion.conversations == ("p",)
    assert await store.head("p/c1") == 0 and await store.head("q") == 0
