"""Appends: store-assigned dense positions, group commit, conflicts, idempotency, bad input.

A contract: every test runs on each backend (see store_backends.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import msgspec
import pytest
from store_backends import AnyStore, Backend

from torpor import ConflictError, EventTooLarge, InvalidInput, StoreError
from torpor.events import AssistantMessage, ToolCall, UserMessage
from torpor.store import ModelCall, SQLiteStore

POISON_SQLITE = (
    "CREATE TRIGGER poison BEFORE INSERT ON events WHEN instr(NEW.body, 'poison') > 0"
    " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
)
POISON_POSTGRES = (
    """
    CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF position('poison' IN encode(NEW.body, 'escape')) > 0 THEN
            RAISE EXCEPTION 'poisoned row';
        END IF;
        RETURN NEW;
    END $$
    """,
    "CREATE TRIGGER poison BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION poison()",
)


def text_of(event: object) -> str:
    return str(event.body.text)  # type: ignore[attr-defined]


async def test_concurrent_appenders_get_dense_unique_positions_and_their_own(
    store: AnyStore,
) -> None:
    conversations, appenders, rounds = 20, 5, 8  # 5 writers per conversation

    told: dict[int, list[tuple[int, str]]] = {c: [] for c in range(conversations)}

    async def appender(conv: int, writer: int) -> None:
        for step in range(rounds):
            texts = [f"c{conv} w{writer} s{step} e{i}" for i in range(1 + step % 3)]
            positions = await store.append(f"conv-{conv}", [UserMessage(t) for t in texts])
            assert positions == list(range(positions[0], positions[0] + len(texts)))
            told[conv].extend(zip(positions, texts, strict=True))

    await asyncio.gather(*(appender(c, w) for c in range(conversations) for w in range(appenders)))
    for conv in range(conversations):
        log = await store.read_since(f"conv-{conv}", 0)
        assert [e.position for e in log] == list(range(len(log)))  # dense, from 0
        assert len(told[conv]) == len(log)  # every acknowledged event, no more
        stored = {e.position: e.body for e in log}
        for position, text in told[conv]:  # each caller was told where *its* event went
            assert stored[position] == UserMessage(text)
        assert await store.head(f"conv-{conv}") == len(log) - 1
    writer = store._writer
    assert writer is not None and writer.largest_batch > 1  # appends were grouped


async def test_expect_head_conflict_writes_nothing(store: AnyStore) -> None:
    assert await store.append("c", [UserMessage("a")], expect_head=-1) == [0]
    assert await store.append("c", [UserMessage("b")], expect_head=0) == [1]
    with pytest.raises(ConflictError) as caught:
        await store.append("c", [UserMessage("stale")], expect_head=0)
    assert (caught.value.expected, caught.value.actual) == (0, 1)
    with pytest.raises(ConflictError):
        await store.append("c", [UserMessage("not empty")], expect_head=-1)
    with pytest.raises(ConflictError):
        await store.append("new", [UserMessage("x")], expect_head=3)
    assert [e.body for e in await store.read_since("c", 0)] == [
        UserMessage("a"),
        UserMessage("b"),
    ]
    assert await store.conversation("new") is None  # a refused append creates nothing
    assert await store.append("c", [UserMessage("c")], expect_head=None) == [2]


async def test_second_writer_with_the_same_expected_head_loses(store: AnyStore) -> None:
    await store.append("c", [UserMessage("a")])
    outcomes = await asyncio.gather(
        store.append("c", [UserMessage("first")], expect_head=0),
        store.append("c", [UserMessage("second")], expect_head=0),
        return_exceptions=True,
    )
    assert outcomes[0] == [1]
    assert isinstance(outcomes[1], ConflictError)
    assert len(await store.read_since("c", 0)) == 2


async def test_invalid_append_in_a_batch_fails_only_itself(store: AnyStore) -> None:
    await store.append("a", [UserMessage("seed")])
    writer = store._writer
    assert writer is not None
    before = writer.batches
    outcomes = await asyncio.gather(
        store.append("a", [UserMessage("ok 1")]),
        store.append("a", [UserMessage("conflict")], expect_head=7),
        store.append("b", [UserMessage("ok 2")]),
        store.append("a", [UserMessage("ok 3")], expect_head=1),
        return_exceptions=True,
    )
    assert writer.batches == before + 1  # all four were in one transaction
    assert outcomes[0] == [1]
    assert isinstance(outcomes[1], ConflictError)
    assert outcomes[2] == [0]
    assert outcomes[3] == [2]  # planned against the head without the refused append
    assert [e.body.text for e in await store.read_since("a", 0)] == [  # type: ignore[union-attr]
        "seed",
        "ok 1",
        "ok 3",
    ]


async def test_a_write_the_database_refuses_fails_alone(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("a", [UserMessage("seed")])
        for statement in POISON_POSTGRES if backend.postgres else (POISON_SQLITE,):
            await backend.sql(statement)
        outcomes = await asyncio.gather(
            store.append("a", [UserMessage("ok 1")]),
            store.append("b", [UserMessage("fine"), UserMessage("poison")]),
            store.append("a", [UserMessage("ok 2")]),
            return_exceptions=True,
        )
        assert outcomes[0] == [1] and outcomes[2] == [2]
        assert isinstance(outcomes[1], StoreError) and "poisoned row" in str(outcomes[1])
        assert await store.head("b") is None  # not even the event before the poisoned one
        assert await store.conversation("b") is None  # its new row was rolled back too
        if backend.postgres:  # the bulk write failed, and the batch was replayed op by op
            assert store._writer is not None and store._writer.stats.isolated == 1
        assert await store.append("b", [UserMessage("later")]) == [0]


async def test_positions_follow_the_log_after_an_out_of_band_write(tmp_path: Path) -> None:
    """SQLite only: its writer caches heads (PostgreSQL reads them under a row lock)."""
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
    store: AnyStore,
) -> None:
    first = await store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
    await store.append("c", [UserMessage("other")])
    again = await store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
    assert first == again == [0, 1]
    # a retry with a stale expected head is still recognised as the same message
    assert await store.append("c", [UserMessage("hi")], key="m1", expect_head=-1) == [0, 1]
    assert len(await store.read_since("c", 0)) == 3
    # keys are per conversation
    assert await store.append("d", [UserMessage("hi")], key="m1") == [0]
    # the same key twice in one batch
    both = await asyncio.gather(
        store.append("e", [UserMessage("x")], key="k"),
        store.append("e", [UserMessage("x")], key="k"),
    )
    assert list(both) == [[0], [0]]
    assert await store.head("e") == 0


async def test_idempotency_keys_are_in_the_database_not_the_process(backend: Backend) -> None:
    async with backend.open() as store:
        first = await store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
        assert first == [0, 1]
        await store.append("c", [UserMessage("other")])
    async with backend.open() as again:
        assert await again.append("c", [UserMessage("hi")], key="m1") == [0, 1]
        events = await again.append_events("c", [UserMessage("hi")], key="m1")
        assert [text_of(e) for e in events] == ["hi", "there"]
        assert len(await again.read_since("c", 0)) == 3


async def test_append_events_returns_what_was_stored(store: AnyStore) -> None:
    body = AssistantMessage("calling", (ToolCall("t1", "grep", {"pattern": "x"}),))
    events = await store.append_events("c", [UserMessage("q"), body], turn=3, key="k")
    assert [e.position for e in events] == [0, 1]
    assert [e.body for e in events] == [UserMessage("q"), body]
    assert all(e.turn == 3 and e.tokens > 0 and e.conversation_id == "c" for e in events)
    assert await store.read_since("c", 0) == events
    assert await store.append_events("c", [UserMessage("q"), body], key="k") == events


async def test_token_counter_is_called_once_per_event_at_append(any_backend: Backend) -> None:
    seen: list[object] = []

    def counter(body: object) -> int:
        seen.append(body)
        return 42

    async with any_backend.open(token_counter=counter) as store:
        await store.append("c", [UserMessage("a"), UserMessage("b")])
        events = await store.read_since("c", 0)
        await store.resume("c")
    assert seen == [UserMessage("a"), UserMessage("b")]
    assert [e.tokens for e in events] == [42, 42]


async def test_append_events_returns_what_was_stored_and_tokens_are_counted_once(
    any_backend: Backend,
) -> None:
    seen: list[object] = []

    def counter(body: object) -> int:
        seen.append(body)
        return 42

    body = AssistantMessage("calling", (ToolCall("t1", "grep", {"pattern": "x"}),))
    async with any_backend.open(token_counter=counter) as store:
        events = await store.append_events("c", [UserMessage("q"), body], turn=3, key="k")
        assert [e.position for e in events] == [0, 1]
        assert all(e.turn == 3 and e.tokens == 42 and e.conversation_id == "c" for e in events)
        assert await store.read_since("c", 0) == events
        await store.resume("c")
        assert seen == [UserMessage("q"), body]  # once each, at append; never on reads
        assert await store.append_events("c", [UserMessage("q"), body], key="k") == events


@pytest.mark.parametrize("bad", ["", "x" * 257, None, 7, b"bytes", "nul\x00inside"])
async def test_bad_conversation_ids_are_refused(store: AnyStore, bad: object) -> None:
    with pytest.raises(ValueError):
        await store.append(bad, [UserMessage("a")])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.read_since(bad, 0)  # type: ignore[arg-type]
    assert await store.conversations() == []


async def test_bad_appends_are_refused_before_anything_is_written(
    store: AnyStore,
) -> None:
    assert await store.append("x" * 256, [UserMessage("longest id is fine")]) == [0]
    with pytest.raises(InvalidInput):
        await store.append("c", [])
    with pytest.raises(InvalidInput):
        await store.append("c", ["not a body"])  # type: ignore[list-item]
    with pytest.raises(EventTooLarge) as caught:
        await store.append("c", [UserMessage("ok"), UserMessage("x" * (1024 * 1024 + 1))])
    assert caught.value.limit == 1024 * 1024
    with pytest.raises(InvalidInput):
        await store.append("c", [UserMessage("a")], key="nul\x00")
    # text no backend can hold as text is refused the same way on both (SQLite too)
    with pytest.raises(InvalidInput):
        await store.append("c", [UserMessage("nul \x00 byte")])
    assert await store.head("c") is None  # the small event went nowhere either


async def test_close_commits_what_is_queued_and_refuses_later_work(backend: Backend) -> None:
    async with backend.open() as store:
        pending = [
            asyncio.ensure_future(store.append(f"c{i}", [UserMessage(str(i))])) for i in range(50)
        ]
        await asyncio.sleep(0)  # let them queue (not a synchronisation: they are already queued)
    assert [p.result() for p in pending] == [[0]] * 50
    with pytest.raises(StoreError):
        await store.append("c0", [UserMessage("late")])
    with pytest.raises(StoreError):
        await store.read_since("c0", 0)
    async with backend.open() as reopened:
        assert len(await reopened.conversations(limit=100)) == 50


async def test_a_cancelled_append_that_was_not_yet_taken_is_never_written(
    store: AnyStore,
) -> None:
    pending = store.append("c", [UserMessage("never")])
    task = asyncio.ensure_future(pending)
    if not isinstance(pending, asyncio.Future):  # a coroutine queues once its task runs
        await asyncio.sleep(0)  # one loop turn: the append is queued, the writer not yet run
    task.cancel()  # (SQLite queued it when called, and hands back the commit's future)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.append("c", [UserMessage("first")]) == [0]
    assert len(await store.read_since("c", 0)) == 1


async def test_an_answer_and_its_audit_row_are_one_operation(store: AnyStore) -> None:
    """The runtime's path (``_append_audited``): both rows in one operation; on a conflict,
    the call's row alone."""
    await store.append("c", [UserMessage("q")], turn=1)
    call = ModelCall("c", 1, 1, 0, b"\x90", "h", {"tail": 1}, 1, 0.1)
    events = await store._append_audited("c", [AssistantMessage("a")], 1, 0, call)
    assert [e.position for e in events] == [1] and events[0].body == AssistantMessage("a")
    stored = await store.model_calls("c")
    assert len(stored) == 1 and stored[0].created_at > 0  # stamped like record_model_call's
    assert msgspec.structs.replace(stored[0], created_at=0) == call
    stale = msgspec.structs.replace(call, call_index=2)
    with pytest.raises(ConflictError):  # a stale head: the answer is refused, the call kept
        await store._append_audited("c", [AssistantMessage("b")], 1, 0, stale)
    with pytest.raises(InvalidInput):  # a row for another conversation is refused
        await store._append_audited(
            "c", [AssistantMessage("b")], 1, 1, msgspec.structs.replace(call, conversation_id="d")
        )
    assert [c.call_index for c in await store.model_calls("c")] == [1, 2]
    assert [e.position for e in await store.read_since("c", 0)] == [0, 1]


async def test_a_user_messages_metadata_is_stored_and_checked_like_its_text(
    store: AnyStore,
) -> None:
    meta = {"user": "alice", "roles": ["buyer", "ops"], "n": 3, "score": 0.5, "ok": True,
            "none": None, "nested": {"tenant": "ünïcode"}}
    await store.append("c", [UserMessage("plain"), UserMessage("with", meta)], key="k")
    assert [e.body for e in await store.read_since("c", 0)] == [
        UserMessage("plain"), UserMessage("with", meta)]
    assert await store.keyed("c", "k") is not None
    for bad in ({"nul": "a\x00b"}, {1: "int key"}, {"set": {1, 2}}, ["not", "a", "dict"]):
        with pytest.raises(InvalidInput) as caught:
            await store.append("c", [UserMessage("bad", bad)])  # type: ignore[arg-type]
        assert "metadata" in caught.value.what
    assert await store.head("c") == 1
