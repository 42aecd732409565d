"""Issue 8, item 14: the pending-approvals index, on both backends.

``store.pending()`` lists every conversation waiting on an outside answer from
an index maintained in the append transaction (Suspended adds, Resolved
removes one call, Aborted removes them all), keyset-paged by conversation id,
and an existing database gets it backfilled from its log when it migrates.
"""

from __future__ import annotations

import asyncio
from typing import Any

from store_backends import MEMORY_TABLES, Backend

from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Resolved,
    Suspended,
    ToolCall,
    ToolResult,
    UserMessage,
)
from torpor.store import OpenCall, PendingApproval, PendingCall


def asks(*calls: tuple[str, str]) -> AssistantMessage:
    return AssistantMessage("I need approval", tuple(ToolCall(i, name) for i, name in calls))


def answer(call_id: str, tool: str) -> list[Body]:
    return [Resolved(call_id), ToolResult(call_id, tool, "approved")]


def waiting(approvals: list[PendingApproval]) -> dict[str, list[tuple[str, str]]]:
    return {a.conversation_id: [(c.call_id, c.tool) for c in a.calls] for a in approvals}


async def test_suspend_resolve_abort(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("a", [UserMessage("deploy please")])
        await store.append("a", [asks(("c1", "approve"), ("c2", "deploy"))])
        (suspended,) = await store.append_events(
            "a", [Suspended(("c1", "c2"), "awaiting approval", ("approve", "deploy"))]
        )
        (approval,) = await store.pending()
        assert approval == PendingApproval(
            "a",
            (
                PendingCall("c1", "approve", suspended.created_at, 2),
                PendingCall("c2", "deploy", suspended.created_at, 2),
            ),
            suspended.created_at,
        )
        await store.append("a", answer("c1", "approve"))
        assert waiting(await store.pending()) == {"a": [("c2", "deploy")]}
        await store.append("a", [Aborted("cancelled")])
        assert await store.pending() == []
        # a new suspension after the abort counts again
        await store.append("a", [asks(("c3", "approve")), Suspended(("c3",), "", ("approve",))])
        assert waiting(await store.pending()) == {"a": [("c3", "approve")]}
        await store.append("a", answer("c3", "approve"))
        assert await store.pending() == []


async def test_changes_within_one_append_and_one_batch(backend: Backend) -> None:
    async with backend.open() as store:
        # suspended and resolved in one append: nothing waits
        await store.append("a", [Suspended(("x",), "", ("t",)), *answer("x", "t")])
        # aborted, then suspended again, in one append: the new call waits
        await store.append("b", [Suspended(("old",), "", ("t",))])
        await store.append("b", [Aborted("crashed"), Suspended(("new",), "", ("t",))])
        # many conversations in one group-commit batch, in every order
        await asyncio.gather(
            store.append("c", [Suspended(("c1",), "", ("t",))]),
            store.append("d", [Suspended(("d1",), "", ("t",))]),
            store.append("c", [Aborted("cancelled")]),
            store.append("c", [Suspended(("c2",), "", ("t",))]),
            store.append("d", answer("d1", "t")),
            store.append("e", [Suspended(("e1", "e2"), "", ("t", "u"))]),
            store.append("e", [Resolved("e2")]),
        )
        assert waiting(await store.pending()) == {
            "b": [("new", "t")],
            "c": [("c2", "t")],
            "e": [("e1", "t")],
        }
        # a refused append changes nothing
        outcomes = await asyncio.gather(
            store.append("e", [Resolved("e1")], expect_head=0), return_exceptions=True
        )
        assert isinstance(outcomes[0], Exception)
        assert waiting(await store.pending())["e"] == [("e1", "t")]


async def test_keyset_paging_in_bytewise_id_order(backend: Backend) -> None:
    names = [f"conv-{i:02d}" for i in range(25)] + ["B", "a", "é", "Z"]
    async with backend.open() as store:
        await asyncio.gather(*(store.append(n, [Suspended((f"{n}-call",))]) for n in names))
        await store.append("idle", [UserMessage("not waiting")])
        seen: list[str] = []
        after: str | None = None
        while page := await store.pending(after=after, limit=10):
            assert len(page) <= 10
            seen += [p.conversation_id for p in page]
            after = page[-1].conversation_id
        assert seen == sorted(names, key=lambda n: n.encode())
        two = await store.pending(after="conv-20", limit=2)
        assert waiting(two) == {n: [(f"{n}-call", "")] for n in ("conv-21", "conv-22")}
        assert await store.pending(after="é") == []


async def test_an_old_database_gets_the_index_backfilled_from_its_log(backend: Backend) -> None:
    """A schema-1 database (built by writing a log, then undoing version 2) migrates."""
    async with backend.open() as store:
        await store.append("a", [UserMessage("x")], key="k")
        await store.append("a", [asks(("a1", "approve"), ("a2", "deploy"))])
        await store.append("a", [Suspended(("a1", "a2"))])  # written before tools existed
        await store.append("a", answer("a1", "approve"))
        await store.append("b", [asks(("b1", "approve")), Suspended(("b1",))])
        await store.append("b", [Aborted("cancelled")])
        await store.append("c", [asks(("c1", "rm")), Suspended(("c1",))])
        await store.append("c", [UserMessage("are you there?")])
        await store.append("d", [Suspended(("d1",))])  # no call to take a name from
        await store.append("e", [Suspended(("e1",), "", ("named",))])
        expected = await store.pending()
    await _downgrade_to_version_1(backend)
    async with backend.open() as store:
        assert waiting(await store.pending()) == {
            "a": [("a2", "deploy")],
            "c": [("c1", "rm")],
            "d": [("d1", "")],
            "e": [("e1", "named")],
        }
        migrated = await store.pending()
        assert [a.conversation_id for a in migrated] == [a.conversation_id for a in expected]
        assert [a.since for a in migrated] == [a.since for a in expected]
        # the migrated database keeps working, keys included
        assert await store.append("a", [UserMessage("x")], key="k") == [0]
        await store.append("c", answer("c1", "rm"))
        assert "c" not in waiting(await store.pending())


async def _downgrade_to_version_1(backend: Backend) -> None:
    await backend.sql("DROP TABLE pending_calls")
    await backend.sql("ALTER TABLE idempotency_keys DROP COLUMN fingerprint")
    await backend.sql("ALTER TABLE events DROP COLUMN hints")
    for table in MEMORY_TABLES:
        await backend.sql(f"DROP TABLE {table}")
    await backend.sql("DROP TABLE event_vectors")  # hybrid recall's tables
    await backend.sql("DROP TABLE vector_progress")
    if backend.name == "sqlite":
        await backend.sql("DROP TABLE fts_backlog")  # version 4
        await backend.sql("PRAGMA user_version = 1")
    else:
        await backend.sql("DELETE FROM schema_version WHERE version > 1")


async def test_pending_summary_counts_the_index_and_names_its_oldest_call(
    backend: Backend,
) -> None:
    from torpor.store import PendingSummary

    async with backend.open() as store:
        assert await store.pending_summary() == PendingSummary(0, 0, None)
        for name in ("a", "b"):
            await store.append(name, [UserMessage("pay")])
            await store.append(name, [asks(("c1", "approve"), ("c2", "approve"))])
        (first,) = await store.append_events(
            "a", [Suspended(("c1", "c2"), "", ("approve", "approve"))])
        await store.append_events("b", [Suspended(("c1",), "", ("approve",))])
        assert await store.pending_summary() == PendingSummary(2, 3, first.created_at)
        await store.append("a", [Aborted("cancelled")])
        summary = await store.pending_summary()
        assert (summary.conversations, summary.calls) == (1, 1)


async def test_open_calls_of_one_conversation_with_their_arguments(store: Any) -> None:
    """``open_calls(c)``: only c's waiting calls, in log order, with the arguments the model
    gave them (the local tool's result between the ask and the Suspended changes nothing)."""
    assert await store.open_calls("a") == []
    await store.append("a", [UserMessage("deploy please")])
    ask = AssistantMessage("checking", (
        ToolCall("c1", "approve", {"what": "deploy 🚀", "n": 2}),
        ToolCall("local", "lookup", {}),
        ToolCall("c2", "deploy", {"env": "prod"}),
    ))
    await store.append("a", [ask, ToolResult("local", "lookup", "found")])
    (suspended,) = await store.append_events(
        "a", [Suspended(("c1", "c2"), "awaiting approval", ("approve", "deploy"))])
    await store.append("b", [asks(("b1", "approve")), Suspended(("b1",), "", ("approve",))])
    at = suspended.created_at
    assert await store.open_calls("a") == [
        OpenCall("c1", "approve", {"what": "deploy 🚀", "n": 2}, at, suspended.position),
        OpenCall("c2", "deploy", {"env": "prod"}, at, suspended.position),
    ]
    await store.append("a", answer("c1", "approve"))
    assert [c.call_id for c in await store.open_calls("a")] == ["c2"]
    await store.append("a", answer("c2", "deploy"))
    assert await store.open_calls("a") == []
    assert [c.call_id for c in await store.open_calls("b")] == ["b1"]
    # a later suspension names the calls of the newest ask, not an older one's
    await store.append("a", [
        AssistantMessage("again", (ToolCall("c3", "approve", {"what": "rollback"}),)),
        Suspended(("c3",), "", ("approve",))])
    (again,) = await store.open_calls("a")
    assert (again.call_id, again.arguments) == ("c3", {"what": "rollback"})
