"""Issue 8, item 9: a hole in the log is a CorruptEvent naming the missing position.

Rows are deleted behind the store's back with raw SQL, on both backends; every
event read (read_since, read_range, page_backward, resume) refuses to skip
the hole, and reads that do not cross it still work.
"""

from __future__ import annotations

from collections.abc import Awaitable

import pytest
from store_backends import Backend

from torpor import CorruptEvent
from torpor.events import Event, UserMessage
from torpor.store import Checkpoint


async def assert_missing(read: Awaitable[object], position: int) -> None:
    with pytest.raises(CorruptEvent) as caught:
        await read
    error = caught.value
    assert (error.conversation_id, error.position, error.detail) == ("c", position, "missing")


def positions(events: list[Event]) -> list[int]:
    return [e.position for e in events]


async def test_a_row_deleted_from_the_middle_is_named_by_every_read(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(str(i)) for i in range(10)])
    await backend.delete_event("c", 5)
    async with backend.open() as store:
        await assert_missing(store.read_since("c", 0), 5)
        await assert_missing(store.read_since("c", 5), 5)
        await assert_missing(store.read_range("c", 0, 9), 5)
        await assert_missing(store.read_range("c", 5, 5), 5)
        await assert_missing(store.page_backward("c"), 5)
        await assert_missing(store.page_backward("c", before=8, limit=3), 5)
        await assert_missing(store.resume("c"), 5)
        # reads that do not cross the hole still work
        assert positions(await store.read_since("c", 6)) == [6, 7, 8, 9]
        assert positions(await store.read_range("c", 0, 4)) == [0, 1, 2, 3, 4]
        assert positions(await store.page_backward("c", limit=4)) == [9, 8, 7, 6]
        assert positions(await store.page_backward("c", before=5)) == [4, 3, 2, 1, 0]
        # a checkpoint after the hole: revival no longer needs it
        await store.put_checkpoint(Checkpoint("c", 6, 0, 1))
        resumed = await store.resume("c")
        assert positions(list(resumed.events)) == [6, 7, 8, 9] and resumed.head == 9


async def test_missing_first_and_last_rows(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(str(i)) for i in range(5)])
    await backend.delete_event("c", 4)
    async with backend.open() as store:
        await assert_missing(store.read_since("c", 0), 4)
        await assert_missing(store.read_since("c", 4), 4)  # nothing left of the tail at all
        await assert_missing(store.read_range("c", 2, 10), 4)
        await assert_missing(store.page_backward("c"), 4)
        await assert_missing(store.resume("c"), 4)
        assert positions(await store.read_range("c", 0, 3)) == [0, 1, 2, 3]
    await backend.delete_event("c", 0)
    async with backend.open() as store:
        await assert_missing(store.read_range("c", 0, 3), 0)
        await assert_missing(store.page_backward("c", before=4), 0)
        assert positions(await store.page_backward("c", before=4, limit=3)) == [3, 2, 1]


async def test_a_dense_log_reads_as_before(backend: Backend) -> None:
    async with backend.open() as store:
        assert await store.read_since("c", 0) == []
        assert await store.page_backward("c") == []
        await store.append("c", [UserMessage(str(i)) for i in range(6)])
        assert positions(await store.read_since("c", 6)) == []
        assert positions(await store.read_since("c", 100)) == []
        assert positions(await store.read_range("c", 4, 100)) == [4, 5]
        assert positions(await store.read_range("c", 4, 2)) == []
        assert positions(await store.page_backward("c", before=100, limit=2)) == [5, 4]
        assert positions(await store.page_backward("c", before=0)) == []
        assert positions(list((await store.resume("c")).events)) == list(range(6))
