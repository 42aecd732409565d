"""Inline group commits (torpor.store.sqlite.writer): a small batch of a file store at
synchronous=NORMAL commits on the event loop's thread; larger batches, a slow disk, a
``full`` store and an in-memory store use the writer thread; maintenance on the writer
connection holds the writer so no batch runs beside it."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

import torpor.store.sqlite.writer as writer_module
from torpor.events import UserMessage
from torpor.store import SQLiteStore


def _writer(store: SQLiteStore) -> Any:
    return store._writer


@pytest.fixture(autouse=True)
def no_batch_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a batch commits is decided here by its size and cost, never by how long the
    last inline one took: on a loaded machine any commit can take over SLOW_INLINE (5 ms)
    and send the next ones to the thread. The test of that rule sets its own threshold."""
    monkeypatch.setattr(writer_module, "SLOW_INLINE", math.inf)


async def test_small_batches_of_a_normal_file_store_commit_inline(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "a.db")) as store:
        for i in range(5):
            await store.append_events("c", [UserMessage(f"m{i}")], expect_head=i - 1)
        writer = _writer(store)
        assert writer.inline_batches == writer.batches == 5
        assert [e.body.text for e in await store.read_since("c", 0)] == [  # type: ignore[attr-defined]
            f"m{i}" for i in range(5)
        ]
    # What an inline batch committed is in the file for the next process.
    with sqlite3.connect(tmp_path / "a.db") as raw:
        assert raw.execute("SELECT count(*) FROM events").fetchone()[0] == 5


@pytest.mark.parametrize("path, durability", [(True, "full"), (False, "normal")])
async def test_full_durability_and_memory_stores_commit_on_the_thread(
    tmp_path: Path, path: bool, durability: str
) -> None:
    location = str(tmp_path / "b.db") if path else None
    async with SQLiteStore(location, durability=durability) as store:  # type: ignore[arg-type]
        await store.append_events("c", [UserMessage("x")], expect_head=-1)
        writer = _writer(store)
        assert writer.batches == 1 and writer.inline_batches == 0


async def test_a_large_batch_goes_to_the_thread(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "c.db")) as store:
        writer = _writer(store)
        writer.hold()  # let a batch larger than INLINE_OPS build up
        appends = [
            asyncio.ensure_future(store.append_events(f"c{i}", [UserMessage("x")], expect_head=-1))
            for i in range(writer_module.INLINE_OPS + 1)
        ]
        await asyncio.sleep(0)  # one loop turn: every append has queued its op
        assert len(writer._queue) == len(appends)
        writer.release()
        await asyncio.gather(*appends)
        assert writer.batches == 1 and writer.inline_batches == 0


async def test_a_slow_inline_batch_sends_the_next_ones_to_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every inline batch is "slow": no elapsed time is below it, however fast the machine.
    monkeypatch.setattr(writer_module, "SLOW_INLINE", -1.0)
    monkeypatch.setattr(writer_module, "AFTER_SLOW", 3)
    async with SQLiteStore(str(tmp_path / "d.db")) as store:
        for i in range(6):
            await store.append_events("c", [UserMessage(f"m{i}")], expect_head=i - 1)
        writer = _writer(store)
        # inline, then 3 on the thread, inline (slow again), then the thread again
        assert writer.batches == 6 and writer.inline_batches == 2


async def test_maintenance_on_the_writer_connection_holds_the_writer(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "e.db")) as store:
        writer = _writer(store)
        seen: list[int] = []

        def probe(conn: sqlite3.Connection) -> None:
            seen.append(writer._holds)

        await store._on_writer(probe)
        assert seen == [1] and writer._holds == 0
        await store.append_events("c", [UserMessage("after")], expect_head=-1)
        assert writer.batches == 1


async def test_a_write_lock_held_elsewhere_never_blocks_the_event_loop(tmp_path: Path) -> None:
    """Another process holding the write lock: the batch waits for it (busy_timeout) on
    the writer thread, never on the loop's, where it would stop every other task."""
    path = tmp_path / "f.db"
    async with SQLiteStore(str(path)) as store:
        await store.append_events("c", [UserMessage("before")], expect_head=-1)
        locked, go, released = threading.Event(), threading.Event(), threading.Event()

        def other_process() -> None:
            other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                other.execute("BEGIN IMMEDIATE")
                locked.set()
                go.wait(timeout=2.0)  # the bound if the loop cannot say so (the bug)
                other.execute("ROLLBACK")
                released.set()
            finally:
                other.close()

        holder = threading.Thread(target=other_process)
        holder.start()
        try:
            await asyncio.to_thread(locked.wait)
            append = asyncio.ensure_future(
                store.append_events("c", [UserMessage("during")], expect_head=0)
            )
            for _ in range(20):  # the writer task takes the batch in one of these turns
                await asyncio.sleep(0)
            assert not released.is_set()  # the loop ran on while the lock was held
            assert not append.done()
        finally:
            go.set()
            await asyncio.to_thread(holder.join)
        (event,) = await append
        assert event.position == 1
        # The lock is gone: small batches commit on the loop's thread again, later on.
        assert [e.body.text for e in await store.read_since("c", 0)] == [  # type: ignore[attr-defined]
            "before", "during"
        ]


async def test_a_batch_known_to_be_costly_goes_to_the_thread(tmp_path: Path) -> None:
    """Much data, or indexing the search backlog (hundreds of rows): on the writer thread,
    decided before the batch runs, so the loop's thread never pays for it."""
    async with SQLiteStore(str(tmp_path / "g.db")) as store:
        writer = _writer(store)
        writer._backlog._flush_rows = 3  # the third small event indexes the backlog
        for i in range(2):
            await store.append_events("c", [UserMessage(f"small {i}")], expect_head=i - 1)
        assert writer.inline_batches == writer.batches == 2
        assert writer.search_backlog == 2
        await store.append_events("c", [UserMessage("small 2")], expect_head=1)
        assert writer.search_backlog == 0  # indexed, with the backlog, on the thread
        assert writer.batches == 3 and writer.inline_batches == 2
        big = "word " * (writer_module.INLINE_BYTES // 5 + 1)
        await store.append_events("c", [UserMessage(big)], expect_head=2)
        assert writer.batches == 4 and writer.inline_batches == 2
        await store.append_events("c", [UserMessage("small again")], expect_head=3)
        assert writer.batches == 5 and writer.inline_batches == 3  # inline once more
        hits = await store.search("c", "small", k=10)
        assert len(hits) == 4
