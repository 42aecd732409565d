"""recall / expand against the real SQLite store, their tool forms, and the audit rebuild."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from msgspec.structs import replace

from torpor.compaction import (
    EXPAND_TOOL,
    RECALL_TOOL,
    CompactionPolicy,
    WorkingSet,
    build_checkpoint,
    expand,
    format_events,
    format_hits,
    make_token_counter,
    plan_fold,
    rebuild_rendered,
    recall,
)
from torpor.errors import StoreError
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.store import open_store
from torpor.store.protocol import EventStore

POLICY = CompactionPolicy(
    context_window=8_000,
    max_output_tokens=500,
    safety_margin=100,
    working_budget=300,
    tail_turns=1,
)


@pytest.fixture
async def store() -> AsyncIterator[EventStore]:
    async with open_store("sqlite://", token_counter=make_token_counter()) as s:
        yield s


async def fill(store: EventStore) -> WorkingSet:
    """Three turns; the first carries a needle and a result big enough to become an artifact."""
    ws = WorkingSet("c", None, [])
    big = "row " * 20_000
    turns: list[list[Body]] = [
        [
            UserMessage("the deploy key is 9f86d081884c7d65 keep it"),
            AssistantMessage("", (ToolCall("t1", "dump", {"table": "users"}),)),
            ToolResult("t1", "dump", big),
            AssistantMessage("dumped"),
        ],
        [UserMessage("second question " * 40), AssistantMessage("second answer " * 40)],
        [UserMessage("third question"), AssistantMessage("third answer")],
    ]
    for turn, bodies in enumerate(turns, start=1):
        ws.append(await store.append_events("c", bodies, turn=turn))
    return ws


async def test_recall_finds_folded_needle_with_scores(store: EventStore) -> None:
    ws = await fill(store)
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    checkpoint = build_checkpoint(plan, None)
    await store.put_checkpoint(checkpoint)
    ws.apply(checkpoint)
    assert all(e.position > 0 for e in ws.tail)  # the needle is out of context
    hits = await recall(store, "c", "9f86d081884c7d65")
    assert hits and hits[0].position == 0 and hits[0].kind == "user"
    text = format_hits(hits)
    assert "event 0 (user" in text and "score" in text and "expand(" in text
    assert await recall(store, "c", "   ") == []
    assert "No matches" in format_hits([])
    with pytest.raises(ValueError):
        await recall(store, "c", "x", k=0)


async def test_expand_returns_exact_events_with_full_artifacts(store: EventStore) -> None:
    await fill(store)
    logged = await store.read_range("c", 2, 2)
    clipped = logged[0].body
    assert isinstance(clipped, ToolResult) and clipped.artifact is not None
    events = await expand(store, "c", 0, 3)
    assert [e.position for e in events] == [0, 1, 2, 3]
    full = events[2].body
    assert isinstance(full, ToolResult) and full.content == "row " * 20_000
    text = format_events(events, max_chars=2_000)
    assert text.startswith("--- event 0 (turn 1")
    assert "calls dump [t1]" in text and "output cut" in text
    with pytest.raises(ValueError):
        await expand(store, "c", 3, 1)


def test_format_events_names_every_kind() -> None:
    bodies: list[Body] = [
        Suspended(("a",), "approval"),
        Resolved("a"),
        Aborted("crashed", "half", "boom"),
        Parked("loops", 3),
        Unparked(),
    ]
    text = format_events([Event("c", i, 1, 0, 0, b) for i, b in enumerate(bodies)])
    for expected in (
        "suspended awaiting a",
        "resolved a",
        "aborted (crashed): boom",
        "partial answer: half",
        "parked after 3 restarts",
        "unparked by operator",
    ):
        assert expected in text
    assert format_events([]) == "No events in that range."


def test_tool_specs_describe_their_arguments() -> None:
    assert RECALL_TOOL.name == "recall" and RECALL_TOOL.parameters["required"] == ["query"]
    assert EXPAND_TOOL.name == "expand" and "start" in EXPAND_TOOL.parameters["properties"]


async def test_audit_rebuild_matches_and_detects_changes(store: EventStore) -> None:
    ws = await fill(store)
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    checkpoint = build_checkpoint(plan, None)
    await store.put_checkpoint(checkpoint)
    ws.apply(checkpoint)
    ws.append(await store.append_events("c", [UserMessage("fourth")], turn=4))
    rendered = ws.render("sys", POLICY, [RECALL_TOOL])
    rebuilt = await rebuild_rendered(store, "c", rendered.recipe, "sys", POLICY, [RECALL_TOOL])
    assert rebuilt.hash == rendered.hash and rebuilt.messages == rendered.messages
    other = await rebuild_rendered(store, "c", rendered.recipe, "other", POLICY, [RECALL_TOOL])
    assert other.hash != rendered.hash
    missing = replace(rendered.recipe, checkpoint_position=99)
    with pytest.raises(StoreError):
        await rebuild_rendered(store, "c", missing, "sys", POLICY, [RECALL_TOOL])


async def test_expand_pages_a_50kb_result_in_full(store: EventStore) -> None:
    big = "".join(f"line {i:05d} of the big result\n" for i in range(1_750))  # ~51 KB
    assert len(big) > 50_000
    await store.append(
        "pages",
        [
            UserMessage("dump it"),
            AssistantMessage("", (ToolCall("t1", "dump", {}),)),
            ToolResult("t1", "dump", big),
        ],
    )
    events = await expand(store, "pages", 2, 2)
    read, offset, calls = [], 0, 0
    while True:
        page = format_events(events, 24_000, offset)
        calls += 1
        body, _, note = page.rpartition("\n[")
        read.append(body)
        assert "characters" in note
        if "end of output" in note:
            break
        offset = int(note.split("offset=")[1].split(")")[0])
        assert len(body) == 24_000
    assert calls == 3
    whole = "".join(read)
    assert whole.endswith(big) and whole.count("line 01749 of") == 1
    assert format_events(events, 24_000, 10**6).startswith("[offset 1000000 is past the end")
    assert "offset" in EXPAND_TOOL.parameters["properties"]
    assert "limit" in EXPAND_TOOL.parameters["properties"]
