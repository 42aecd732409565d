"""Issue 9, item 2: WAL checkpoints run beside the group commit, never inside it.

The writer runs with SQLite's automatic checkpoint off; the store's
checkpointer (its own connection and thread) keeps the WAL bounded. Bounds are
asserted on the WAL file's bytes as measured after every write, never on how
long something took.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import torpor.store.sqlite.checkpoint as checkpoint_module
from torpor.events import UserMessage
from torpor.store import SQLiteStore
from torpor.store.sqlite.checkpoint import Checkpointer, CheckpointPolicy

LIMIT = 256 * 1024  # the smallest WAL bound worth testing (the minimum is 128 KiB)
BODY = "words that take room in the write-ahead log " * 25  # ~1.1 KB per event


def wal_bytes(path: Path) -> int:
    try:
        return os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        return 0


def checkpointer(store: SQLiteStore) -> Checkpointer:
    ckpt = store._checkpointer
    assert ckpt is not None
    return ckpt


class Gauge:
    """The WAL size after every commit (as the writer measures it) and the rewinds so far."""

    def __init__(self, store: SQLiteStore) -> None:
        self.commits: list[tuple[int, int]] = []  # (WAL bytes, rewinds before this commit)
        writer = store._write()
        ckpt = checkpointer(store)
        forward = writer.on_commit
        assert forward is not None

        def on_commit(size: int) -> None:
            self.commits.append((size, ckpt.rewinds))
            forward(size)

        writer.on_commit = on_commit

    def largest(self) -> int:
        return max(size for size, _ in self.commits)

    def check_bound(self, limit: int) -> None:
        """No batch was committed while the WAL was past the bound: a rewind came first.

        So the file outgrows the bound by one batch at most: the one that crossed it.
        """
        for (before, rewinds), (_, later) in zip(self.commits, self.commits[1:], strict=False):
            if before > limit:
                assert later > rewinds, "a batch was committed past the hard bound"


async def write_steadily(
    store: SQLiteStore, path: Path, *, writers: int, appends: int
) -> tuple[int, int]:
    """``writers`` tasks append back to back; the largest WAL seen after any append, bytes in."""
    largest = 0
    written = 0

    async def writer(n: int) -> None:
        nonlocal largest, written
        for i in range(appends):
            await store.append(f"conv-{n}", [UserMessage(f"{i} {BODY}")])
            written += len(BODY)
            largest = max(largest, wal_bytes(path))

    await asyncio.gather(*(writer(n) for n in range(writers)))
    return largest, written


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError):
        CheckpointPolicy(wal_limit=1024)
    with pytest.raises(ValueError):
        CheckpointPolicy(interval=0)
    with pytest.raises(ValueError):
        SQLiteStore(None, idle_checkpoint=-1)


async def test_writer_never_checkpoints_inside_a_commit(tmp_path: Path) -> None:
    async with SQLiteStore(str(tmp_path / "log.db")) as store:
        conn = store._write().connection
        rows = await store._on_writer(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone())
        assert rows == (0,)
        assert conn is store._write().connection


async def test_wal_stays_bounded_under_sustained_writes(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    # No timer: only the WAL's size drives the checkpointer here.
    async with SQLiteStore(str(path), wal_limit=LIMIT, checkpoint_interval=3600) as store:
        gauge = Gauge(store)
        largest, written = await write_steadily(store, path, writers=8, appends=250)
        assert checkpointer(store).rewinds >= 3
    assert written > 8 * LIMIT  # unchecked, the WAL would have held all of it
    gauge.check_bound(LIMIT)
    # Past the bound by one batch at most (8 appends, or an FTS merge: a few hundred KB).
    assert largest == gauge.largest() <= 4 * LIMIT


async def test_hard_bound_holds_the_writer_when_checkpoints_fall_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow passive checkpoint lets the WAL reach the hard bound: the writer waits, then
    the WAL is rewound, and the file never grew past the bound by more than a batch."""
    real = checkpoint_module._wal_checkpoint

    def slow(conn: sqlite3.Connection, mode: checkpoint_module.Mode) -> tuple[int, int, int]:
        if mode == "PASSIVE":
            time.sleep(0.1)  # on the checkpointer's thread; writes go on meanwhile
        return real(conn, mode)

    monkeypatch.setattr(checkpoint_module, "_wal_checkpoint", slow)
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), wal_limit=LIMIT, checkpoint_interval=3600) as store:
        gauge = Gauge(store)
        largest, _ = await write_steadily(store, path, writers=8, appends=100)
        assert checkpointer(store).rewinds >= 2
    assert any(size > LIMIT for size, _ in gauge.commits)  # the hard bound was reached
    gauge.check_bound(LIMIT)
    assert largest <= 4 * LIMIT


async def test_writes_never_fail_even_without_a_busy_timeout(tmp_path: Path) -> None:
    """With busy_timeout=0 any lock met is an error: the writer must never meet the
    checkpointer's (the blocking checkpoints run while the writer is held)."""
    path = tmp_path / "log.db"
    async with SQLiteStore(
        str(path), wal_limit=LIMIT, checkpoint_interval=0.01, busy_timeout=0
    ) as store:
        gauge = Gauge(store)
        await write_steadily(store, path, writers=4, appends=300)
        assert checkpointer(store).rewinds >= 3
        assert checkpointer(store).checkpoints["PASSIVE"] >= 3
        heads = [await store.head(f"conv-{n}") for n in range(4)]
    assert heads == [299] * 4
    gauge.check_bound(LIMIT)


async def test_idle_store_truncates_its_wal(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), idle_checkpoint=0.05, checkpoint_interval=0.01) as store:
        for i in range(50):
            await store.append("c", [UserMessage(f"{i} {BODY}")])
        assert wal_bytes(path) > 0
        for _ in range(750):  # wait for the idle checkpoint, up to ~15 s on a slow machine
            if wal_bytes(path) == 0:
                break
            await asyncio.sleep(0.02)
        assert wal_bytes(path) == 0
        assert checkpointer(store).checkpoints["TRUNCATE"] >= 1
        # and writing afterwards is as usual
        assert await store.append("c", [UserMessage("after")]) == [50]


async def test_checkpointer_stops_with_the_store(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "log.db"), checkpoint_interval=0.01)
    async with store:
        ckpt = checkpointer(store)
        task = ckpt._task
        assert task is not None and not task.done()
        await store.append("c", [UserMessage("one")])
        await asyncio.sleep(0.05)
    assert task.done() and task.cancelled()
    assert store._checkpointer is None
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert "torpor-checkpointer" not in names and "torpor-writer" not in names


@pytest.fixture
def slow_checkpoints(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every checkpoint takes 0.3 s on its thread; the event is set when one starts."""
    started = threading.Event()
    real = checkpoint_module._wal_checkpoint

    def slow(conn: sqlite3.Connection, mode: checkpoint_module.Mode) -> tuple[int, int, int]:
        started.set()
        time.sleep(0.3)
        return real(conn, mode)

    monkeypatch.setattr(checkpoint_module, "_wal_checkpoint", slow)
    yield started


async def test_store_closed_mid_checkpoint(
    tmp_path: Path, slow_checkpoints: threading.Event
) -> None:
    path = tmp_path / "log.db"
    store = SQLiteStore(str(path), checkpoint_interval=0.01)
    async with store:
        await store.append("c", [UserMessage("before")])
        await asyncio.to_thread(slow_checkpoints.wait, 5)
        # close while the checkpoint runs on its thread
    async with SQLiteStore(str(path)) as again:
        assert [e.position for e in await again.read_since("c", 0)] == [0]


async def test_store_closed_mid_rewind_commits_what_waited(
    tmp_path: Path, slow_checkpoints: threading.Event
) -> None:
    """Writes queued while the writer is held for a rewind are committed at close."""
    path = tmp_path / "log.db"
    store = SQLiteStore(str(path), idle_checkpoint=0.01, checkpoint_interval=3600)
    async with store:
        await store.append("c", [UserMessage("before")])
        await asyncio.to_thread(slow_checkpoints.wait, 5)  # the idle TRUNCATE, writer held
        assert store._write()._holds == 1
        late = [asyncio.ensure_future(store.append("c", [UserMessage(f"late {i}")]))
                for i in range(3)]
        await asyncio.sleep(0)
        assert not any(f.done() for f in late)
    assert sorted(p for f in late for p in f.result()) == [1, 2, 3]
    async with SQLiteStore(str(path)) as again:
        assert [e.position for e in await again.read_since("c", 0)] == [0, 1, 2, 3]


async def test_readers_keep_working_through_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), wal_limit=LIMIT, checkpoint_interval=0.01) as store:
        await store.append("c0", [UserMessage("needle in the log")])
        stop = False
        reads = 0

        async def reader() -> None:
            nonlocal reads
            while not stop:
                events = await store.read_since("c0", 0)
                assert [e.position for e in events] == list(range(len(events)))
                assert (await store.search("c0", "needle"))[0].position == 0
                assert len(await store.page_backward("c0", limit=5)) >= 1
                reads += 1

        readers = [asyncio.ensure_future(reader()) for _ in range(3)]
        try:
            await write_steadily(store, path, writers=4, appends=200)
        finally:
            stop = True
            await asyncio.gather(*readers)
        assert reads > 0
        assert checkpointer(store).rewinds >= 1


async def test_reader_pinning_the_wal_never_fails_a_write(tmp_path: Path) -> None:
    """An outside reader holding an old snapshot keeps the WAL from being rewound: writes go
    on (the writer is never left held), and once the reader lets go the WAL is bounded again."""
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), wal_limit=LIMIT, checkpoint_interval=0.01) as store:
        await store.append("c", [UserMessage("first")])
        outside = sqlite3.connect(path, isolation_level=None)
        try:
            outside.execute("BEGIN")
            assert outside.execute("SELECT count(*) FROM events").fetchone() == (1,)
            pinned, _ = await write_steadily(store, path, writers=4, appends=150)
            assert pinned > LIMIT  # the bound could not be kept while the snapshot was held
        finally:
            outside.execute("COMMIT")
            outside.close()
        # the hard bound re-arms after a failed rewind; the next rewind succeeds
        rewinds = checkpointer(store).rewinds
        for i in range(200):
            await store.append("c", [UserMessage(f"{i} {BODY}")])
            if checkpointer(store).rewinds > rewinds:
                break
            await asyncio.sleep(0.005)
        assert checkpointer(store).rewinds > rewinds
        assert await store.head("c") is not None


async def test_idle_truncate_blocked_by_a_reader_does_not_spin(tmp_path: Path) -> None:
    """An idle TRUNCATE that a reader's snapshot defeats is retried after another idle
    spell, not at once: the writer is not held over and over, writes go through."""
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path), idle_checkpoint=0.1, checkpoint_interval=3600) as store:
        await store.append("c", [UserMessage("first")])
        outside = sqlite3.connect(path, isolation_level=None)
        try:
            outside.execute("BEGIN")
            outside.execute("SELECT count(*) FROM events").fetchone()
            await store.append("c", [UserMessage("second")])  # the snapshot predates it
            loop = asyncio.get_running_loop()
            start = loop.time()
            for _ in range(750):  # until three attempts were made (up to ~15 s under load)
                if checkpointer(store).checkpoints["TRUNCATE"] >= 3:
                    break
                await asyncio.sleep(0.02)
            elapsed = loop.time() - start
            attempts = checkpointer(store).checkpoints["TRUNCATE"]
            assert attempts >= 3
            # About one per idle spell (0.1 s), however slow the machine: not a busy loop.
            assert attempts <= elapsed / 0.1 + 3, (attempts, elapsed)
            assert checkpointer(store).rewinds == 0 and wal_bytes(path) > 0
            assert await store.append("c", [UserMessage("third")]) == [2]
        finally:
            outside.execute("COMMIT")
            outside.close()
        for _ in range(750):  # the reader is gone: the next idle spell truncates
            if wal_bytes(path) == 0:
                break
            await asyncio.sleep(0.02)
        assert wal_bytes(path) == 0
