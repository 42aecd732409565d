"""Schedules in the store, on every backend: add (keyed: idempotent), list, cancel, the due
index, and firing as part of an append (exactly once: a second firing for the same due
time, or one after a cancel, writes nothing)."""

from __future__ import annotations

import asyncio

import pytest
from store_backends import AnyStore

from torpor.errors import (
    IdempotencyConflict,
    InvalidInput,
    ScheduleGone,
    TooManySchedules,
    UnknownConversation,
)
from torpor.events import UserMessage
from torpor.store.schedules import Firing, check_new, next_due

NOW = 1_000_000


def _new(conversation: str, text: str = "ping", **kw: object):  # type: ignore[no-untyped-def]
    args = {"at": None, "after": None, "every": None, "key": None, "now": NOW}
    args.update(kw)
    return check_new(conversation, text, **args)  # type: ignore[arg-type]


async def test_add_list_cancel_and_keys(store: AnyStore) -> None:
    with pytest.raises(UnknownConversation):
        await store.add_schedule(_new("nobody", after=1))
    await store.append("c", [UserMessage("hi")], turn=1)
    first = await store.add_schedule(_new("c", after=10))
    keyed = await store.add_schedule(_new("c", "digest", after=5, every=60, key="k"))
    assert keyed.every == 60.0 and keyed.due == NOW + 5_000
    # A retry (later, so after= gives another due time) returns the stored schedule.
    again = await store.add_schedule(_new("c", "digest", after=5, every=60, key="k", now=NOW + 7))
    assert again == keyed
    with pytest.raises(IdempotencyConflict):
        await store.add_schedule(_new("c", "other", after=5, every=60, key="k"))
    assert [s.id for s in await store.conversation_schedules("c")] == [keyed.id, first.id]
    assert {s.id for s in await store.list_schedules()} == {first.id, keyed.id}
    page = await store.list_schedules(limit=1)
    assert len(page) == 1 and (await store.list_schedules(after=page[0].id))[0].id != page[0].id
    assert await store.remove_schedule("c", first.id) is True
    assert await store.remove_schedule("c", first.id) is False
    assert await store.remove_schedule("other", keyed.id) is False
    assert await store.remove_schedule("c", keyed.id) is True
    assert await store.conversation_schedules("c") == []
    # A cancelled keyed schedule is kept for its key: a retry does not schedule it again.
    retried = await store.add_schedule(_new("c", "digest", after=5, every=60, key="k"))
    assert retried.id == keyed.id and retried.due is None
    assert await store.conversation_schedules("c") == []


async def test_at_most_counts_pending(store: AnyStore) -> None:
    await store.append("c", [UserMessage("hi")], turn=1)
    added = await asyncio.gather(
        *(store.add_schedule(_new("c", f"n{i}", after=i), at_most=3) for i in range(5)),
        return_exceptions=True,
    )
    assert sum(isinstance(a, TooManySchedules) for a in added) == 2
    assert len(await store.conversation_schedules("c")) == 3


async def test_due_index(store: AnyStore) -> None:
    for name in ("a", "b"):
        await store.append(name, [UserMessage("hi")], turn=1)
    late = await store.add_schedule(_new("a", after=30))
    soon = await store.add_schedule(_new("b", after=10))
    assert [s.id for s in await store.due_schedules(until=NOW + 10_000)] == [soon.id]
    assert [s.id for s in await store.due_schedules(until=NOW + 99_000)] == [soon.id, late.id]
    assert await store.due_schedules(until=NOW) == []
    assert await store.next_due(after=NOW) == NOW + 10_000
    assert await store.next_due(after=NOW + 10_000) == NOW + 30_000
    assert await store.next_due(after=NOW + 30_000) is None


async def test_firing_is_one_transaction_exactly_once(store: AnyStore) -> None:
    await store.append("c", [UserMessage("hi")], turn=1)
    once = await store.add_schedule(_new("c", "once", after=1))
    every = await store.add_schedule(_new("c", "tick", after=1, every=10))
    assert once.due is not None and every.due is not None
    fired = await store.append_events(
        "c", [UserMessage("once", scheduled=once.id)], turn=2, expect_head=0,
        fired=Firing(once.id, once.due, None),
    )
    assert fired[0].position == 1 and fired[0].body == UserMessage("once", scheduled=once.id)
    with pytest.raises(ScheduleGone):  # fired already: nothing written
        await store.append_events("c", [UserMessage("once")], turn=3, expect_head=1,
                                  fired=Firing(once.id, once.due, None))
    step = next_due(every.due, 10_000, every.due + 25_000)
    assert step == every.due + 30_000  # missed intervals: once, phase kept
    await store.append_events("c", [UserMessage("tick")], turn=3, expect_head=1,
                              fired=Firing(every.id, every.due, step))
    with pytest.raises(ScheduleGone):  # the old due time again
        await store.append_events("c", [UserMessage("tick")], turn=4, expect_head=2,
                                  fired=Firing(every.id, every.due, step))
    [moved] = await store.conversation_schedules("c")
    assert moved.due == step and moved.fired == 1
    # A refused append (stale head) does not move the schedule.
    with pytest.raises(Exception):  # noqa: B017 - ConflictError
        await store.append_events("c", [UserMessage("tick")], turn=4, expect_head=0,
                                  fired=Firing(every.id, step, step + 10_000))
    assert (await store.conversation_schedules("c"))[0].due == step
    assert await store.remove_schedule("c", every.id)
    with pytest.raises(ScheduleGone):  # cancelled
        await store.append_events("c", [UserMessage("tick")], turn=4, expect_head=2,
                                  fired=Firing(every.id, step, None))
    assert await store.head("c") == 2


async def test_two_firings_in_one_batch(store: AnyStore) -> None:
    await store.append("c", [UserMessage("hi")], turn=1)
    await store.append("d", [UserMessage("hi")], turn=1)
    s = await store.add_schedule(_new("c", after=1))
    assert s.due is not None
    results = await asyncio.gather(
        store.append_events("c", [UserMessage("x")], turn=2, fired=Firing(s.id, s.due, None)),
        store.append_events("c", [UserMessage("x")], turn=3, fired=Firing(s.id, s.due, None)),
        store.append_events("d", [UserMessage("x")], turn=2, fired=Firing(s.id, s.due, None)),
        return_exceptions=True,
    )
    assert [isinstance(r, ScheduleGone) for r in results] == [False, True, True]
    assert await store.head("c") == 1 and await store.head("d") == 0


async def test_delete_takes_schedules(store: AnyStore) -> None:
    await store.append("c", [UserMessage("hi")], turn=1)
    s = await store.add_schedule(_new("c", after=1))
    deletion = await store.delete("c")
    assert deletion is not None and deletion.rows["schedules"] == 1
    assert await store.list_schedules() == []
    assert s.due is not None
    with pytest.raises(ScheduleGone):  # a firing racing the delete creates nothing
        await store.append_events("c", [UserMessage("x")], turn=1, fired=Firing(s.id, s.due, None))
    assert await store.head("c") is None


def test_bad_requests() -> None:
    for kw in ({}, {"at": 5, "after": 5}, {"after": -1}, {"after": "soon"},
               {"after": 1, "every": 0.5}, {"after": float("nan")}, {"after": True}):
        with pytest.raises(InvalidInput):
            _new("c", **kw)
    with pytest.raises(InvalidInput):
        _new("c", "", after=1)
    with pytest.raises(InvalidInput):
        _new("c", "x" * 20_000, after=1)
    from datetime import datetime
    with pytest.raises(InvalidInput):
        _new("c", at=datetime(2030, 1, 1))  # naive
    assert _new("c", every=60).due == NOW + 60_000  # every alone: one interval from now


async def test_due_schedules_of_some_shards_read_past_the_others(store: AnyStore) -> None:
    """A node reads only its shards' schedules, also when more of other shards' are due
    first than one page holds (the keyset pages go on past them)."""
    from torpor.cluster import shard_of

    count = 4
    names = [f"c{i}" for i in range(40)]
    mine = [shard_of("c0", count)]
    ours = [n for n in names if shard_of(n, count) in mine]
    theirs = [n for n in names if shard_of(n, count) not in mine]
    order = theirs[:12] + ours  # more of theirs due first than the page below holds
    due = {}
    for i, name in enumerate(order):
        await store.append(name, [UserMessage("hi")], turn=1)
        due[name] = await store.add_schedule(_new(name, after=1 + i))
    got = await store.due_schedules(until=NOW + 10_000_000, limit=3, shards=mine,
                                    shard_count=count)
    assert [s.conversation_id for s in got] == ours[:3]
    assert await store.next_due(after=NOW, shards=mine, shard_count=count) == \
        due[ours[0]].due
    assert await store.due_schedules(until=NOW + 10_000_000, shards=[], shard_count=count) == []
