"""Appends: store-assigned dense positions, group commit, conflicts, idempotency, bad input."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from torpor import ConflictError, EventTooLarge, InvalidInput, StoreError
from torpor.events import AssistantMessage, ToolCall, UserMessage
from torpor.store import SQLiteStore


async def test_concurrent_appenders_get_dense_unique_positions_and_their_own(
    sqlite_store: SQLiteStore,
) -> None:
    conversations, appenders, rounds = 20, 5, 8  # 5 writers per conversation

    told: dict[int, list[tuple[int, str]]] = {c: [] for c in range(conversations)}

    async def appender(conv: int, writer: int) -> None:
        for step in range(rounds):
            texts = [f"c{conv} w{writer} s{step} e{i}" for i in range(1 + step % 3)]
            positions = await sqlite_store.append(f"conv-{conv}", [UserMessage(t) for t in texts])
            assert positions == list(range(positions[0], positions[0] + len(texts)))
            told[conv].extend(zip(positions, texts, strict=True))

    await asyncio.gather(*(appender(c, w) for c in range(conversations) for w in range(appenders)))
    for conv in range(conversations):
        log = await sqlite_store.read_since(f"conv-{conv}", 0)
        assert [e.position for e in log] == list(range(len(log)))  # dense, from 0
        assert len(told[conv]) == len(log)  # every acknowledged event, no more
        stored = {e.position: e.body for e in log}
        for position, text in told[conv]:  # each caller was told where *its* event went
            assert stored[position] == UserMessage(text)
        assert await sqlite_store.head(f"conv-{conv}") == len(log) - 1
    writer = sqlite_store._writer
    assert writer is not None and writer.largest_batch > 1  # appends were grouped


async def test_expect_head_conflict_writes_nothing(sqlite_store: SQLiteStore) -> None:
    assert await sqlite_store.append("c", [UserMessage("a")], expect_head=-1) == [0]
    assert await sqlite_store.append("c", [UserMessage("b")], expect_head=0) == [1]
    with pytest.raises(ConflictError) as caught:
        await sqlite_store.append("c", [UserMessage("stale")], expect_head=0)
    assert (caught.value.expected, caught.value.actual) == (0, 1)
    with pytest.raises(ConflictError):
        await sqlite_store.append("c", [UserMessage("not empty")], expect_head=-1)
    with pytest.raises(ConflictError):
        await sqlite_store.append("new", [UserMessage("x")], expect_head=3)
    assert [e.body for e in await sqlite_store.read_since("c", 0)] == [
        UserMessage("a"),
        UserMessage("b"),
    ]
    assert await sqlite_store.conversation("new") is None  # a refused append creates nothing
    assert await sqlite_store.append("c", [UserMessage("c")], expect_head=None) == [2]


async def test_second_writer_with_the_same_expected_head_loses(sqlite_store: SQLiteStore) -> None:
    await sqlite_store.append("c", [UserMessage("a")])
    outcomes = await asyncio.gather(
        sqlite_store.append("c", [UserMessage("first")], expect_head=0),
        sqlite_store.append("c", [UserMessage("second")], expect_head=0),
        return_exceptions=True,
    )
    assert outcomes[0] == [1]
    assert isinstance(outcomes[1], ConflictError)
    assert len(await sqlite_store.read_since("c", 0)) == 2


async def test_invalid_append_in_a_batch_fails_only_itself(sqlite_store: SQLiteStore) -> None:
    await sqlite_store.append("a", [UserMessage("seed")])
    writer = sqlite_store._writer
    assert writer is not None
    before = writer.batches
    outcomes = await asyncio.gather(
        sqlite_store.append("a", [UserMessage("ok 1")]),
        sqlite_store.append("a", [UserMessage("conflict")], expect_head=7),
        sqlite_store.append("b", [UserMessage("ok 2")]),
        sqlite_store.append("a", [UserMessage("ok 3")], expect_head=1),
        return_exceptions=True,
    )
    assert writer.batches == before + 1  # all four were in one transaction
    assert outcomes[0] == [1]
    assert isinstance(outcomes[1], ConflictError)
    assert outcomes[2] == [0]
    assert outcomes[3] == [2]  # planned against the head without the refused append
    assert [e.body.text for e in await sqlite_store.read_since("a", 0)] == [  # type: ignore[union-attr]
        "seed",
        "ok 1",
        "ok 3",
    ]


async def test_a_write_that_fails_in_sqlite_fails_alone(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("a", [UserMessage("seed")])
        raw = sqlite3.connect(path)
        raw.execute(
            "CREATE TRIGGER poison BEFORE INSERT ON events WHEN instr(NEW.body, 'poison') > 0"
            " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
        )
        raw.commit()
        raw.close()
        outcomes = await asyncio.gather(
            store.append("a", [UserMessage("ok 1")]),
            store.append("b", [UserMessage("fine"), UserMessage("poison")]),
            store.append("a", [UserMessage("ok 2")]),
            return_exceptions=True,
        )
        assert outcomes[0] == [1] and outcomes[2] == [2]
        assert isinstance(outcomes[1], StoreError) and "poisoned row" in str(outcomes[1])
        assert await store.head("b") is None  # not even the event before the poisoned one
        assert await store.conversation("b") is None
        assert await store.append("b", [UserMessage("later")]) == [0]


async def test_positions_follow_the_log_after_an_out_of_band_write(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("c", [UserMessage("0")])
        # a row written behind the store's back makes its cached head stale: the
        # batch's bulk write hits the primary key, and the store re-reads the head
        raw = sqlite3.connect(path)
        raw.execute(
            "INSERT INTO events SELECT conversation_id, 1, turn, kind, tokens, created_at, body,"
            " hints FROM events WHERE position = 0"
        )
        raw.commit()
        raw.close()
        assert await store.append("c", [UserMessage("2")]) == [2]
        assert [e.position for e in await store.read_since("c", 0)] == [0, 1, 2]


async def test_idempotency_key_returns_the_first_positions_and_writes_nothing(
    sqlite_store: SQLiteStore,
) -> None:
    first = await sqlite_store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
    await sqlite_store.append("c", [UserMessage("other")])
    again = await sqlite_store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
    assert first == again == [0, 1]
    # a retry with a stale expected head is still recognised as the same message
    assert await sqlite_store.append("c", [UserMessage("hi")], key="m1", expect_head=-1) == [0, 1]
    assert len(await sqlite_store.read_since("c", 0)) == 3
    # keys are per conversation
    assert await sqlite_store.append("d", [UserMessage("hi")], key="m1") == [0]
    # the same key twice in one batch
    both = await asyncio.gather(
        sqlite_store.append("e", [UserMessage("x")], key="k"),
        sqlite_store.append("e", [UserMessage("x")], key="k"),
    )
    assert list(both) == [[0], [0]]
    assert await sqlite_store.head("e") == 0


async def test_append_events_returns_what_was_stored(sqlite_store: SQLiteStore) -> None:
    body = AssistantMessage("calling", (ToolCall("t1", "grep", {"pattern": "x"}),))
    events = await sqlite_store.append_events("c", [UserMessage("q"), body], turn=3, key="k")
    assert [e.position for e in events] == [0, 1]
    assert [e.body for e in events] == [UserMessage("q"), body]
    assert all(e.turn == 3 and e.tokens > 0 and e.conversation_id == "c" for e in events)
    assert await sqlite_store.read_since("c", 0) == events
    assert await sqlite_store.append_events("c", [UserMessage("q"), body], key="k") == events


async def test_token_counter_is_called_once_per_event_at_append() -> None:
    seen: list[object] = []

    def counter(body: object) -> int:
        seen.append(body)
        return 42

    async with SQLiteStore(None, token_counter=counter) as store:
        await store.append("c", [UserMessage("a"), UserMessage("b")])
        events = await store.read_since("c", 0)
        await store.resume("c")
    assert seen == [UserMessage("a"), UserMessage("b")]
    assert [e.tokens for e in events] == [42, 42]


@pytest.mark.parametrize("bad", ["", "x" * 257, None, 7, b"bytes"])
async def test_bad_conversation_ids_are_refused(sqlite_store: SQLiteStore, bad: object) -> None:
    with pytest.raises(ValueError):
        await sqlite_store.append(bad, [UserMessage("a")])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await sqlite_store.read_since(bad, 0)  # type: ignore[arg-type]
    assert await sqlite_store.conversations() == []


async def test_bad_appends_are_refused_before_anything_is_written(
    sqlite_store: SQLiteStore,
) -> None:
    assert await sqlite_store.append("x" * 256, [UserMessage("longest id is fine")]) == [0]
    with pytest.raises(InvalidInput):
        await sqlite_store.append("c", [])
    with pytest.raises(InvalidInput):
        await sqlite_store.append("c", ["not a body"])  # type: ignore[list-item]
    with pytest.raises(EventTooLarge) as caught:
        await sqlite_store.append("c", [UserMessage("ok"), UserMessage("x" * (1024 * 1024 + 1))])
    assert caught.value.limit == 1024 * 1024
    assert await sqlite_store.head("c") is None  # the small event went nowhere either


async def test_close_commits_what_is_queued_and_refuses_later_writes(tmp_path: Path) -> None:
    path = str(tmp_path / "log.db")
    store = SQLiteStore(path)
    await store.open()
    pending = [
        asyncio.ensure_future(store.append(f"c{i}", [UserMessage(str(i))])) for i in range(50)
    ]
    await asyncio.sleep(0)  # let them queue (not a synchronisation: they are already queued)
    await store.close()
    assert [p.result() for p in pending] == [[0]] * 50
    with pytest.raises(StoreError):
        await store.append("c0", [UserMessage("late")])
    async with SQLiteStore(path) as reopened:
        assert len(await reopened.conversations(limit=100)) == 50


async def test_a_cancelled_append_that_was_not_yet_taken_is_never_written(
    sqlite_store: SQLiteStore,
) -> None:
    task = asyncio.ensure_future(sqlite_store.append("c", [UserMessage("never")]))
    await asyncio.sleep(0)  # one loop turn: the append is queued, the writer not yet run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await sqlite_store.append("c", [UserMessage("first")]) == [0]
    assert len(await sqlite_store.read_since("c", 0)) == 1
