"""Topic hints stored at append: kept with the row on both backends, handed back on every
read, absent (None) for rows written before them, and folding the same either way."""

from __future__ import annotations

import msgspec
import pytest
from store_backends import MEMORY_TABLES, Backend

from torpor.compaction import CompactionPolicy, WorkingSet, build_checkpoint, plan_fold
from torpor.compaction.markers import decode_hints, encode_hints, event_hints
from torpor.errors import ConfigError
from torpor.events import AssistantMessage, Body, Event, ToolCall, ToolResult, UserMessage

POLICY = CompactionPolicy(
    context_window=16_000, max_output_tokens=1_000, safety_margin=200, working_budget=300,
    tail_turns=2,
)


def turn(i: int) -> list[Body]:
    return [
        UserMessage(f"Deploy /srv/app{i}/conf.yaml with retry_ms={i} please"),
        AssistantMessage("", (ToolCall(f"t{i}", "grep", {"q": f"service_{i}.log"}),)),
        ToolResult(f"t{i}", "grep", f"found in src/mod_{i}.py " + "line " * 40),
        AssistantMessage(f"Done: commit {i:07x}abc is live" if i % 2 else "ok"),
    ]


async def test_hints_are_stored_and_read_back_with_the_event(backend: Backend) -> None:
    async with backend.open(hint_extractor=encode_hints, artifact_threshold=1024) as store:
        logged: list[Event] = []
        for i in range(6):
            logged += await store.append_events("c", turn(i), turn=i + 1)
        big = ToolResult("t9", "grep", "x.py " * 2000)  # clipped on entry into an artifact
        logged += await store.append_events("c", [big], turn=7)
        for event in logged:  # of the body as stored (a clipped result: of its preview)
            assert event.hints == encode_hints(event.body)
            assert decode_hints(event.hints) == event_hints(event)
        assert logged[-1].body != big
        assert await store.read_since("c", 0) == logged
        assert (await store.resume("c")).events == tuple(logged)
        assert await store.read_range("c", 3, 9) == logged[3:10]
        assert await store.page_backward("c", limit=4) == logged[::-1][:4]
        again = await store.append_events("c", [UserMessage("k")], turn=8, key="k")
        assert await store.append_events("c", [UserMessage("k")], turn=8, key="k") == again


async def test_without_an_extractor_nothing_is_stored(backend: Backend) -> None:
    async with backend.open() as store:
        logged = await store.append_events("c", turn(0), turn=1)
        assert all(e.hints is None for e in logged)
        assert all(e.hints is None for e in await store.read_since("c", 0))


async def test_an_extractor_must_return_bytes(backend: Backend) -> None:
    async with backend.open(hint_extractor=lambda body: "text") as store:
        with pytest.raises(ConfigError, match="hint_extractor"):
            await store.append("c", [UserMessage("x")])
        assert await store.head("c") is None


async def test_rows_from_before_hints_fold_as_rows_with_them(backend: Backend) -> None:
    async with backend.open(hint_extractor=encode_hints) as store:
        for i in range(5):
            await store.append("c", turn(i), turn=i + 1)
    # The database as version 2 left it: no hints column (nor, on SQLite, fts_backlog).
    await backend.sql("ALTER TABLE events DROP COLUMN hints")
    for table in MEMORY_TABLES:
        await backend.sql(f"DROP TABLE {table}")
    if backend.name == "sqlite":
        await backend.sql("DROP TABLE fts_backlog")  # version 4
        await backend.sql("PRAGMA user_version = 2")
    else:
        await backend.sql("DELETE FROM schema_version WHERE version > 2")
    async with backend.open(hint_extractor=encode_hints) as store:
        for i in range(5, 10):
            await store.append("c", turn(i), turn=i + 1)
        events = (await store.resume("c")).events
    assert [e.hints is None for e in events] == [e.position < 20 for e in events]
    bare = [msgspec.structs.replace(e, hints=None) for e in events]
    for log in (events, bare):
        ws = WorkingSet("c", None, log)
        plan = plan_fold(ws, POLICY)
        assert plan is not None
        checkpoint = build_checkpoint(plan, None, created_at=0)
        if log is events:
            expected = (plan.hints, checkpoint)
        else:
            assert (plan.hints, checkpoint) == expected
    assert any(m.topics for m in expected[1].markers)
