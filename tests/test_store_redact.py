"""Redaction at the store, on every backend (torpor.store.redact).

One event's body is replaced in place by a ``Redacted`` one, and every derived copy of
its text goes with it: the full-text entry, the artifact, the vectors, the folds that
covered it (checkpoints after it, their memory items and the ledger decisions naming
them), a model call's topic label, a default title. Positions stay dense, the rest of
the conversation stays, one ``deletions`` row says what was done (never the text). On
SQLite the text is in no file of the store afterwards; on PostgreSQL in no row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_backends import AnyStore, Backend

from torpor.errors import InvalidInput, UnknownConversation
from torpor.events import (
    REDACTED_TEXT,
    AssistantMessage,
    Redacted,
    Suspended,
    ToolCall,
    ToolResult,
    UserMessage,
    presented,
)
from torpor.store import SQLiteStore
from torpor.store.memory import EpisodicItem, LedgerEntry, SemanticItem
from torpor.store.protocol import Checkpoint, ModelCall
from torpor.store.vectors import vector_index

SECRET = "zqxsecretwombat7731"


async def _fill(store: AnyStore, name: str) -> None:
    """The secret in the user message at 0 only, copied into a fold (summary, marker
    topics' source), its memory items, a vector and a model call's topic; the rest of
    the conversation holds other words."""
    await store.append(name, [UserMessage(f"my password is {SECRET}")])  # 0
    call = ToolCall("call-1", "fetch", {"url": "x"})
    await store.append(name, [AssistantMessage("looking", (call,))], turn=1)  # 1
    await store.append(name, [ToolResult("call-1", "fetch", "kept result " * 10)], turn=1)  # 2
    await store.append(name, [AssistantMessage("noted the keeper")], turn=1)  # 3
    await store.append(name, [UserMessage("second question about llamas")], turn=2)  # 4
    await store.put_checkpoint(Checkpoint(name, 1, 1, 1, summary="nothing yet"))
    await store.put_checkpoint(Checkpoint(name, 4, 2, 2, summary=f"the user said {SECRET}"))
    await store.record_model_call(ModelCall(name, 1, 0, 2, b"recipe", "h", {}, 10, 0.1,
                                            topic=SECRET))
    await store.record_model_call(ModelCall(name, 2, 0, 2, b"recipe", "h", {}, 10, 0.1,
                                            topic="llamas"))
    await store.put_memory(
        name,
        episodes=[EpisodicItem(1, 0, 0, (1,), "early"),
                  EpisodicItem(4, 0, 3, (1,), f"talked about {SECRET}")],
        facts=[SemanticItem(4, 0, "password", "fact", f"password {SECRET}")],
    )
    await store.put_ledger(name, [LedgerEntry("password", "update", "4.0", reason=SECRET)])
    await vector_index(store).put(name, "space", [(0, [1.0, 0.0]), (4, [0.0, 1.0])], 4)


async def test_redact_replaces_the_body_and_every_copy(backend: Backend) -> None:
    async with backend.open() as store:
        await _fill(store, "c")
        await store.search("c", "llamas")  # some entries in the index proper
        before = await store.page_backward("c", limit=100)

        assert await store.redact("c", 0, reason="pasted a password") is True

        after = await store.page_backward("c", limit=100)
        assert [e.position for e in after] == [e.position for e in before]  # dense
        body = next(e.body for e in after if e.position == 0)
        assert isinstance(body, Redacted)
        assert (body.kind, body.reason) == ("user", "pasted a password") and body.at > 0
        assert [e.body for e in after if e.position] == [e.body for e in before if e.position]
        assert presented(after[-1]).body == UserMessage(REDACTED_TEXT)
        assert await store.search("c", SECRET) == []
        assert [h.position for h in await store.search("c", "llamas")] == [4]
        assert [c.position for c in await store.checkpoints("c")] == []  # both covered 0
        resume = await store.resume("c")
        assert resume.checkpoint is None and len(resume.events) == 5
        memory = await store.memory("c")
        assert memory.episodes == () and memory.facts == () and memory.ledger == ()
        topics = [c.topic for c in await store.model_calls("c")]
        assert topics == [None, "llamas"]
        info = await store.conversation("c")
        assert info is not None and info.title == "" and info.event_count == 5
        (deletion,) = await store.deletions()
        assert deletion.by == "redact" and deletion.conversations == ("c",)
        assert deletion.rows["position"] == 0 and deletion.rows["checkpoints"] == 2
        assert deletion.rows["event_vectors"] == 1 and deletion.rows["memory_facts"] == 1
        # No table holds the secret (PostgreSQL: every row as text; bytea as hex).
        tables = await _tables(backend)
        assert "events" in tables and "deletions" in tables
        for table in tables:
            for row in await _dump(backend, table):
                assert SECRET not in row and SECRET.encode().hex() not in row, table


async def test_a_redaction_keeps_folds_before_it_and_the_turn_structure(store: AnyStore) -> None:
    await _fill(store, "c")
    assert await store.redact("c", 2) is True  # a tool result, in the fold at 4 only
    assert [c.position for c in await store.checkpoints("c")] == [1]
    memory = await store.memory("c")
    assert [e.position for e in memory.episodes] == [1]
    resumed = await store.resume("c")
    assert resumed.checkpoint is not None and resumed.checkpoint.position == 1
    shown = presented((await store.read_range("c", 2, 2))[0]).body
    assert shown == ToolResult("call-1", "fetch", REDACTED_TEXT)  # still answers call-1
    assert await store.redact("c", 1) is True  # the call: ids and names kept, no arguments
    shown = presented((await store.read_range("c", 1, 1))[0]).body
    assert shown == AssistantMessage(REDACTED_TEXT, (ToolCall("call-1", "fetch"),))
    info = await store.conversation("c")
    assert info is not None and info.title.startswith("my password")  # not from these


async def test_twice_is_a_no_op_and_bad_input_is_refused(store: AnyStore) -> None:
    await _fill(store, "c")
    await store.append("c", [AssistantMessage("", (ToolCall("a", "approve"),)),
                             Suspended(("a",), "", ("approve",))], turn=3)
    assert await store.redact("c", 0, reason="r") is True
    assert await store.redact("c", 0, reason="r") is False  # a retry: nothing written
    assert len(await store.deletions()) == 1
    with pytest.raises(InvalidInput, match="redacted already"):
        await store.redact("c", 0, reason="another")
    with pytest.raises(InvalidInput, match="no event at 99"):
        await store.redact("c", 99)
    with pytest.raises(InvalidInput, match="'suspended'"):
        await store.redact("c", 6)
    with pytest.raises(InvalidInput):
        await store.redact("c", -1)
    with pytest.raises(UnknownConversation):
        await store.redact("nobody", 0)
    assert len(await store.deletions()) == 1


async def test_an_embedding_racing_a_redaction_stores_no_vector(store: AnyStore) -> None:
    await store.append("c", [UserMessage(f"my password is {SECRET}")])
    await store.redact("c", 0)
    # The embedder read the event before the redaction; its vector lands after it.
    await vector_index(store).put("c", "space", [(0, [1.0, 0.0])], 0)
    hits = await vector_index(store).nearest("c", "space", [1.0, 0.0], 5)
    assert hits == []


async def test_bytes_gone_from_every_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "store" / "log.db"
    path.parent.mkdir()
    async with SQLiteStore(str(path)) as store:
        await _fill(store, "c")
        big = f"{SECRET} " + "lorem ipsum " * 20_000  # ~240 KB: an artifact
        await store.append("c", [ToolResult("call-9", "fetch", big)], turn=3)  # 5
        await store.append("c", [AssistantMessage(f"noted: {SECRET}")], turn=3)  # 6
        await store.search("c", "llamas")  # some entries in the index proper, some not
        await store.append("c", [UserMessage(f"and again {SECRET}")], turn=4)  # 7: backlog
        for position in (0, 5, 6, 7):
            assert await store.redact("c", position) is True
        files = {f.name: f.read_bytes() for f in path.parent.iterdir()}
        assert set(files) >= {"log.db", "log.db-wal"}
        assert [n for n, data in files.items() if SECRET.encode() in data] == []
        assert await store.search("c", "llamas") != []
        assert await store.search("c", "lorem") == []
    for file in path.parent.iterdir():
        assert SECRET.encode() not in file.read_bytes(), file.name


async def _tables(backend: Backend) -> list[str]:
    if backend.postgres:
        rows = await backend.sql(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
        )
    else:  # the contentless index is checked by the file scan
        rows = await backend.sql(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'events_fts%'"
        )
    return [str(r[0]) for r in rows]


async def _dump(backend: Backend, table: str) -> list[str]:
    if backend.postgres:
        return [str(r[0]) for r in await backend.sql(f"SELECT t::text FROM {table} AS t")]
    rows = await backend.sql(f"SELECT * FROM {table}")
    return [repr(row) + " " + " ".join(
        bytes(v).hex() for v in row if isinstance(v, bytes | memoryview)) for row in rows]
