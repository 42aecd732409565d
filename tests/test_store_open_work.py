"""Issue 20, item 3: the open-work index, on every backend.

``store.open_work()`` lists the conversations a process that died left owing a
run: a turn neither answered, aborted nor suspended, or user messages logged
behind it. A suspension or parking blocks them (they wait for an answer, or an
operator); an answer to the suspension unblocks them. The index is moved in the
append transaction, so a refused or replayed append moves nothing, and every
log it says is closed is one that revival (``torpor.actors.revive.restore``, the
truth) finds nothing to run in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from store_backends import AnyStore, Backend

from torpor.actors.revive import restore
from torpor.actors.state import AgentState
from torpor.errors import ConflictError, InvalidInput
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
from torpor.store.fence import shard_of

Step = tuple[int, Body]  # (turn, body), appended in this order

ASKS = AssistantMessage("let me check", (ToolCall("c1", "lookup"),))
APPROVE = AssistantMessage("needs approval", (ToolCall("a1", "deploy"), ToolCall("a2", "rm")))


async def write(store: AnyStore, conversation: str, steps: Sequence[Step]) -> None:
    for turn, body in steps:
        await store.append(conversation, [body], turn=turn)


async def is_open(store: AnyStore, conversation: str) -> bool:
    return conversation in await store.open_work()


async def test_a_user_message_opens_and_a_final_answer_or_an_abort_closes(store: AnyStore) -> None:
    await store.append("a", [UserMessage("hi")], turn=1)
    assert await store.open_work() == ["a"]
    await store.append("a", [ASKS, ToolResult("c1", "lookup", "found")], turn=1)
    assert await is_open(store, "a")  # a step with tool calls ends nothing
    await store.append("a", [AssistantMessage("done")], turn=1)
    assert await store.open_work() == []
    await store.append("a", [UserMessage("again")], turn=2)
    assert await is_open(store, "a")
    await store.append("a", [Aborted("interrupted")], turn=2)
    assert await store.open_work() == []
    await store.append("b", [UserMessage("turn 0 counts too")])  # the default turn
    assert await store.open_work() == ["b"]


async def test_postponed_messages_keep_it_open_until_their_own_turns_end(store: AnyStore) -> None:
    await write(store, "p", [(1, UserMessage("first")), (2, UserMessage("second")),
                             (3, UserMessage("third"))])
    await store.append("p", [AssistantMessage("one")], turn=1)
    assert await is_open(store, "p")
    await store.append("p", [Aborted("cancelled")], turn=2)
    assert await is_open(store, "p")
    await store.append("p", [AssistantMessage("three")], turn=3)
    assert not await is_open(store, "p")


async def test_a_suspension_blocks_its_postponed_turns_and_its_answer_reopens(
    store: AnyStore,
) -> None:
    await write(store, "s", [(1, UserMessage("deploy")), (1, APPROVE),
                             (1, Suspended(("a1", "a2"), "approval", ("deploy", "rm")))])
    assert not await is_open(store, "s")  # waits for an outside answer: nothing to run
    await store.append("s", [UserMessage("are you there?")], turn=2)
    assert not await is_open(store, "s")  # postponed behind the suspension: waits with it
    await store.append("s", [ToolResult("a1", "deploy", "ok"), Resolved("a1")], turn=1)
    assert await is_open(store, "s")  # (a2 still waits: the index errs towards waking)
    await store.append("s", [ToolResult("a2", "rm", "ok"), Resolved("a2")], turn=1)
    assert await is_open(store, "s")  # the continuation of turn 1, then turn 2, are owed
    await store.append("s", [AssistantMessage("deployed")], turn=1)
    assert await is_open(store, "s")
    await store.append("s", [AssistantMessage("yes")], turn=2)
    assert not await is_open(store, "s")
    # a cancelled suspension ends its turn: nothing blocks what follows
    await write(store, "t", [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("c1",))),
                             (2, UserMessage("y")), (1, Aborted("cancelled"))])
    assert await is_open(store, "t")


async def test_parking_blocks_until_unparked(store: AnyStore) -> None:
    await write(store, "k", [(1, UserMessage("x")), (1, Aborted("crashed")),
                             (2, UserMessage("y")), (2, Parked("boom", 3))])
    assert not await is_open(store, "k")
    await store.append("k", [Unparked()], turn=2)
    assert await is_open(store, "k")
    await store.append("k", [AssistantMessage("y!")], turn=2)
    assert not await is_open(store, "k")


async def test_a_refused_or_replayed_append_changes_nothing(store: AnyStore) -> None:
    await store.append("r", [UserMessage("x")], turn=1, key="k1")
    await store.append("r", [AssistantMessage("x!")], turn=1)
    with pytest.raises(ConflictError):
        await store.append("r", [UserMessage("stale")], turn=2, expect_head=0)
    assert await store.open_work() == []
    # the same key again: the first append's positions, and no new turn opened
    assert await store.append("r", [UserMessage("x")], turn=7, key="k1") == [0]
    assert await store.open_work() == []


async def test_one_batch_many_conversations_every_order(store: AnyStore) -> None:
    await asyncio.gather(
        store.append("m1", [UserMessage("a")], turn=1),
        store.append("m2", [UserMessage("b")], turn=1),
        store.append("m1", [AssistantMessage("a!")], turn=1),
        store.append("m2", [ASKS, Suspended(("c1",))], turn=1),
        store.append("m3", [UserMessage("c"), AssistantMessage("c!"), UserMessage("d")], turn=1),
        store.append("m2", [UserMessage("later")], turn=2),
        store.append("m4", [UserMessage("e")], turn=1),
        store.append("m4", [Parked("boom")], turn=1),
    )
    # m3: its second message joined turn 1 (as an old version logged them): answered
    assert await store.open_work() == []
    await asyncio.gather(
        store.append("m2", [ToolResult("c1", "lookup", "ok"), Resolved("c1")], turn=1),
        store.append("m4", [Unparked()], turn=1),
        store.append("m5", [UserMessage("f")], turn=1),
        store.append("m5", [AssistantMessage("f!")], turn=1),
        store.append("m5", [UserMessage("g")], turn=2),
    )
    assert await store.open_work() == ["m2", "m4", "m5"]


async def test_keyset_pages_in_bytewise_id_order_and_shards_filter(store: AnyStore) -> None:
    names = [f"conv-{i:02d}" for i in range(25)] + ["B", "a", "é", "Z"]
    await asyncio.gather(*(store.append(n, [UserMessage("x")], turn=1) for n in names))
    await store.append("closed", [UserMessage("x"), AssistantMessage("y")], turn=1)
    seen: list[str] = []
    after: str | None = None
    while page := await store.open_work(after=after, limit=10):
        assert len(page) <= 10
        seen += page
        after = page[-1]
    assert seen == sorted(names, key=lambda n: n.encode())
    assert await store.open_work(after="conv-20", limit=2) == ["conv-21", "conv-22"]
    assert await store.open_work(after="é") == []
    for shard in range(4):  # a node asking for its shards gets exactly theirs, paged
        theirs = [n for n in seen if shard_of(n, 4) == shard]
        got: list[str] = []
        after = None
        while page := await store.open_work(shards=[shard], shard_count=4, after=after, limit=3):
            got += page
            after = page[-1]
        assert got == theirs
    assert await store.open_work(shards=[], shard_count=4) == []
    with pytest.raises(InvalidInput):
        await store.open_work(shards=[1])  # which shard a row is in needs the count
    with pytest.raises(InvalidInput):
        await store.open_work(shards=[4], shard_count=4)


# -- the index against revival ------------------------------------------------------------

SCENARIOS: dict[str, list[Step]] = {
    "idle": [(1, UserMessage("x")), (1, AssistantMessage("y"))],
    "cut mid-stream": [(1, UserMessage("x"))],
    "cut mid-tools": [(1, UserMessage("x")), (1, ASKS), (1, ToolResult("c1", "lookup", "r"))],
    "cut with postponed": [(1, UserMessage("x")), (2, UserMessage("y")), (1, ASKS)],
    "postponed after the answer": [(1, UserMessage("x")), (2, UserMessage("y")),
                                   (1, AssistantMessage("x!"))],
    "drained at shutdown": [(1, UserMessage("x")), (2, UserMessage("y")),
                            (1, Aborted("shutdown")), (2, Aborted("shutdown"))],
    "suspended": [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("c1",)))],
    "suspended with postponed": [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("c1",))),
                                 (2, UserMessage("y"))],
    "resolved, cut": [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("c1",))),
                      (1, ToolResult("c1", "lookup", "r")), (1, Resolved("c1"))],
    "cancelled while suspended": [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("c1",))),
                                  (2, UserMessage("y")), (1, Aborted("cancelled"))],
    "parked": [(1, UserMessage("x")), (1, Aborted("crashed")), (1, Parked("boom"))],
    "parked mid-turn": [(1, UserMessage("x")), (1, Parked("boom"))],
    "unparked mid-turn": [(1, UserMessage("x")), (1, Parked("boom")), (1, Unparked())],
    "interrupted, then answered": [(1, UserMessage("x")), (1, Aborted("interrupted")),
                                   (2, UserMessage("y")), (2, AssistantMessage("y!"))],
}


def owes(events: list[Event]) -> bool:
    """What revival would run: an open turn to abort, or postponed turns to run."""
    restored = restore(events)
    if restored.state in (AgentState.PARKED, AgentState.SUSPENDED):
        return False
    return restored.unfinished or bool(restored.postponed)


async def test_the_index_agrees_with_revival_on_every_scenario(store: AnyStore) -> None:
    for name, steps in SCENARIOS.items():
        await write(store, name, steps)
    listed = set(await store.open_work())
    for name in SCENARIOS:
        assert (name in listed) == owes(await store.read_since(name, 0)), name


# -- an existing database -------------------------------------------------------------------


async def test_an_older_database_gets_the_index_backfilled_from_its_log(backend: Backend) -> None:
    async with backend.open() as store:
        for name, steps in SCENARIOS.items():
            await write(store, name, steps)
        expected = await store.open_work()
    assert expected  # some owe work, some do not
    await _downgrade_to_version_6(backend)
    async with backend.open() as store:
        assert await store.open_work() == expected
        await store.append("cut mid-stream", [AssistantMessage("late")], turn=1)
        assert "cut mid-stream" not in await store.open_work()  # and it keeps moving


async def _downgrade_to_version_6(backend: Backend) -> None:
    await backend.sql("DROP INDEX conversations_open")
    if backend.postgres:
        await backend.sql("DROP INDEX conversations_open_by_shard")
    for column in ("user_turn", "settled_turn", "suspended", "parked"):
        await backend.sql(f"ALTER TABLE conversations DROP COLUMN {column}")
    if backend.name == "sqlite":
        await backend.sql("PRAGMA user_version = 6")
    else:
        await backend.sql("DELETE FROM schema_version WHERE version > 6")


# -- PostgreSQL: a node's fenced writes ----------------------------------------------------


async def test_a_fenced_append_moves_nothing_and_rows_are_found_by_shard(pg_url: str) -> None:
    asyncpg = pytest.importorskip("asyncpg")
    from test_cluster_leases import SHARDS, FixedFence, ids_in_distinct_shards, leases_table

    from torpor.errors import FencedError
    from torpor.store.postgres import PostgresStore

    await leases_table(pg_url)
    a, b = ids_in_distinct_shards(2)
    async with PostgresStore(pg_url) as solo:  # a single node's row: no shard of its own
        await solo.append("solo", [UserMessage("x")], turn=1)
    fence = FixedFence({s: 1 for s in range(SHARDS)})
    async with PostgresStore(pg_url, fence=fence) as store:
        for name in (a, b):
            await store.append(name, [UserMessage("x"), AssistantMessage("y")], turn=1)
        conn = await asyncpg.connect(pg_url)
        try:  # another node took b's shard over
            await conn.execute(
                "UPDATE shard_leases SET epoch = 2 WHERE shard = $1", shard_of(b, SHARDS)
            )
        finally:
            await conn.close()
        outcomes = await asyncio.gather(
            store.append(a, [UserMessage("opens")], turn=2),
            store.append(b, [UserMessage("fenced")], turn=2),
            return_exceptions=True,
        )
        assert outcomes[0] == [2] and isinstance(outcomes[1], FencedError)
        assert await store.open_work() == [a, "solo"]
        for name in (a, b, "solo"):
            mine = await store.open_work(shards=[shard_of(name, SHARDS)], shard_count=SHARDS)
            assert mine == ([] if name == b else [name])
        others = [s for s in range(SHARDS) if s not in (shard_of(a, SHARDS),
                                                         shard_of("solo", SHARDS))]
        assert await store.open_work(shards=others, shard_count=SHARDS) == []


async def test_the_query_reads_the_partial_index_not_every_conversation(
    backend: Backend,
) -> None:
    async with backend.open() as store:
        await store.append("open", [UserMessage("x")], turn=1)
    # Many conversations that owe nothing, as the statistics see them.
    await backend.sql(
        "WITH RECURSIVE n(value) AS (SELECT 1 UNION ALL SELECT value + 1 FROM n "
        "WHERE value < 20000) INSERT INTO conversations (external_id, created_at, updated_at, "
        "user_turn, settled_turn) SELECT 'done-' || value, 0, 0, 1, 1 FROM n"
    )
    await backend.sql("ANALYZE")
    if backend.postgres:
        from torpor.store.postgres.reads import _OPEN_ALL, _OPEN_IN

        plans = [await backend.sql(f"EXPLAIN {_OPEN_ALL}", "", 100),
                 await backend.sql(f"EXPLAIN {_OPEN_IN}", "", 100, [1, 2])]
    else:
        from torpor.store.sqlite.reads import _OPEN

        plans = [await backend.sql(f"EXPLAIN QUERY PLAN {_OPEN}", "", 100)]
    for plan in plans:
        text = " ".join(str(part) for row in plan for part in row)
        assert "conversations_open" in text, text
        assert "Seq Scan" not in text and "external_id_key" not in text, text
