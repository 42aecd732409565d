"""Reads: scrollback, read_since after a checkpoint, resume, listings, model calls.

A contract: every test runs on each backend (see store_backends.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from store_backends import AnyStore, Backend

from torpor.events import Aborted, Body, Suspended, UserMessage
from torpor.store import Checkpoint, Marker, ModelCall


def text_of(event: Any) -> str:
    return str(event.body.text)


async def fill(store: AnyStore, conv: str, count: int) -> None:
    for start in range(0, count, 7):
        n = min(7, count - start)
        await store.append(conv, [UserMessage(f"m{start + i}") for i in range(n)], turn=start)


@pytest.mark.parametrize("limit", [1, 3, 7, 50, 1000])
async def test_page_backward_walks_the_whole_log_exactly_once(
    store: AnyStore, limit: int
) -> None:
    await fill(store, "c", 103)
    await fill(store, "other", 5)
    seen: list[int] = []
    before = None
    while True:
        page = await store.page_backward("c", before=before, limit=limit)
        if not page:
            break
        assert len(page) <= limit
        assert [e.position for e in page] == sorted((e.position for e in page), reverse=True)
        seen.extend(e.position for e in page)
        before = page[-1].position
    assert seen == list(range(102, -1, -1))
    assert all(e.conversation_id == "c" for e in await store.page_backward("c"))


async def test_read_since_after_a_checkpoint_returns_the_tail(store: AnyStore) -> None:
    await fill(store, "c", 30)
    marker = Marker(start=0, end=19, start_ms=1, end_ms=2, topics=("setup",))
    checkpoint = Checkpoint("c", position=20, created_at=5, cycle=1, markers=(marker,), tokens=9)
    await store.put_checkpoint(checkpoint)
    latest = await store.latest_checkpoint("c")
    assert latest == checkpoint
    tail = await store.read_since("c", latest.position)
    assert [e.position for e in tail] == list(range(20, 30))
    assert [e.body for e in tail] == [UserMessage(f"m{i}") for i in range(20, 30)]
    # a checkpoint deletes nothing
    assert len(await store.read_since("c", 0)) == 30
    later = Checkpoint("c", position=25, created_at=6, cycle=2, summary="so far")
    await store.put_checkpoint(later)
    assert await store.latest_checkpoint("c") == later
    assert await store.checkpoints("c") == [checkpoint, later]
    info = await store.conversation("c")
    assert info is not None and info.checkpoint_position == 25


async def test_resume_is_latest_checkpoint_plus_events_since(store: AnyStore) -> None:
    empty = await store.resume("nobody")
    assert (empty.head, empty.checkpoint, empty.events) == (None, None, ())
    await fill(store, "c", 12)
    whole = await store.resume("c")
    assert whole.head == 11 and whole.checkpoint is None and len(whole.events) == 12
    await store.put_checkpoint(Checkpoint("c", 10, 0, 1))
    await store.append("c", [Suspended(("t1",), "approval")])
    resumed = await store.resume("c")
    assert resumed.head == 12
    assert resumed.checkpoint is not None and resumed.checkpoint.position == 10
    assert [e.position for e in resumed.events] == [10, 11, 12]
    assert resumed.events[-1].body == Suspended(("t1",), "approval")


async def test_checkpoints_cannot_cover_events_that_do_not_exist(
    store: AnyStore,
) -> None:
    await fill(store, "c", 3)
    await store.put_checkpoint(Checkpoint("c", 3, 0, 1))  # covers everything: fine
    with pytest.raises(ValueError):
        await store.put_checkpoint(Checkpoint("c", 4, 0, 2))
    with pytest.raises(ValueError):
        await store.put_checkpoint(Checkpoint("c", -1, 0, 2))
    assert len(await store.checkpoints("c")) == 1


async def test_read_range_head_and_unknown_conversations(store: AnyStore) -> None:
    await fill(store, "c", 10)
    assert [e.position for e in await store.read_range("c", 3, 5)] == [3, 4, 5]
    assert await store.head("c") == 9
    assert await store.head("missing") is None
    assert await store.read_since("missing", 0) == []
    assert await store.page_backward("missing") == []
    assert await store.latest_checkpoint("missing") is None
    assert await store.conversation("missing") is None


async def test_conversations_are_listed_by_keyset_with_their_heads(
    store: AnyStore,
) -> None:
    names = [f"conv-{i:02d}" for i in range(25)]
    for i, name in enumerate(reversed(names)):
        await store.append(name, [UserMessage("x")] * (1 + i % 3))
    listed = []
    after = None
    while page := await store.conversations(after=after, limit=7):
        listed.extend(page)
        after = page[-1].conversation_id
    assert [info.conversation_id for info in listed] == names
    for info in listed:
        count = len(await store.read_since(info.conversation_id, 0))
        assert info.head == count - 1 and info.event_count == count
        assert info.bytes > 0 and info.created_at <= info.updated_at


async def test_model_calls_round_trip(store: AnyStore) -> None:
    calls = [
        ModelCall(
            conversation_id="c",
            turn=turn,
            call_index=index,
            compaction_cycle=0,
            recipe=b"\x90",
            rendered_hash=f"h{turn}{index}",
            sections={"system": 10, "tail": 100},
            estimated_prompt_tokens=110,
            utilization=0.1,
            latency_ms=12.5,
            created_at=1000 + turn,
        )
        for turn in range(1, 4)
        for index in range(2)
    ]
    await store.append("c", [UserMessage("x")])  # only an append creates a conversation
    for call in calls:
        await store.record_model_call(call)
    assert await store.model_calls("c") == calls
    assert await store.model_calls("c", turn=2) == calls[2:4]
    assert await store.model_calls("c", limit=3) == calls[3:]
    assert await store.model_calls("other") == []


async def test_all_event_kinds_survive_the_round_trip(store: AnyStore) -> None:
    bodies: list[Body] = [
        UserMessage("u"),
        Aborted("model_error", "partial", "boom"),
        Suspended(("a", "b")),
    ]
    await store.append("c", bodies, turn=4)
    events = await store.read_since("c", 0)
    assert [e.body for e in events] == bodies
    assert [e.kind for e in events] == ["user", "aborted", "suspended"]


async def test_read_since_after_a_checkpoint_and_resume_in_one_round_trip(
    any_backend: Backend, store: AnyStore
) -> None:
    empty = await store.resume("nobody")
    assert (empty.head, empty.checkpoint, empty.events) == (None, None, ())
    for i in range(30):
        await store.append("c", [UserMessage(f"m{i}")])
    first = Checkpoint("c", position=20, created_at=5, cycle=1, tokens=9)
    await store.put_checkpoint(first)
    assert await store.latest_checkpoint("c") == first
    tail = await store.read_since("c", 20)
    assert [text_of(e) for e in tail] == [f"m{i}" for i in range(20, 30)]
    assert len(await store.read_since("c", 0)) == 30  # a checkpoint deletes nothing
    later = Checkpoint("c", position=25, created_at=6, cycle=2, summary="so far")
    await store.put_checkpoint(later)
    await store.append("c", [Suspended(("t1",), "approval")])
    assert await store.checkpoints("c") == [first, later]
    with pytest.raises(ValueError):
        await store.put_checkpoint(Checkpoint("c", 32, 0, 3))  # beyond head + 1

    if any_backend.postgres:  # one statement, so one snapshot (SQLite: one read transaction)
        calls: list[str] = []
        pool = store._pool

        class Counting:  # the store's reader pool, counting the statements sent through it
            def __getattr__(self, name: str) -> Any:
                method = getattr(pool, name)

                async def counted(query: str, *args: Any) -> Any:
                    calls.append(query)
                    return await method(query, *args)

                return counted

        store._pool = Counting()
        resumed = await store.resume("c")
        store._pool = pool
        assert len(calls) == 1  # checkpoint, head and events: one statement
    else:
        resumed = await store.resume("c")
    assert resumed.head == 30 and resumed.checkpoint == later
    assert [e.position for e in resumed.events] == list(range(25, 31))
    info = await store.conversation("c")
    assert info is not None and info.checkpoint_position == 25 and info.head == 30


async def test_listings_in_bytewise_order_heads_ranges_and_stamped_model_calls(
    store: AnyStore,
) -> None:
    names = [f"conv-{i:02d}" for i in range(12)] + ["Zeta", "alpha"]  # bytewise order
    for i, name in enumerate(reversed(names)):
        await store.append(name, [UserMessage("x")] * (1 + i % 3))
    listed = []
    after = None
    while page := await store.conversations(after=after, limit=5):
        listed.extend(page)
        after = page[-1].conversation_id
    assert [info.conversation_id for info in listed] == sorted(names)
    for info in listed:
        count = len(await store.read_since(info.conversation_id, 0))
        assert info.head == count - 1 and info.event_count == count and info.bytes > 0
    assert [e.position for e in await store.read_range("conv-00", 0, 1)] == [0, 1]
    assert await store.head("missing") is None and await store.read_since("missing", 0) == []
    calls = [
        ModelCall("c", turn, index, 0, b"\x90", f"h{turn}{index}", {"tail": 100}, 110, 0.1)
        for turn in range(1, 4)
        for index in range(2)
    ]
    await store.append("c", [UserMessage("x")])  # only an append creates a conversation
    for call in calls:
        await store.record_model_call(call)
    stored = await store.model_calls("c")
    assert [(c.turn, c.call_index) for c in stored] == [(c.turn, c.call_index) for c in calls]
    assert all(c.created_at > 0 for c in stored)  # stamped
    assert [c.rendered_hash for c in await store.model_calls("c", turn=2)] == ["h20", "h21"]
    assert len(await store.model_calls("c", limit=3)) == 3
