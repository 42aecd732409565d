"""Issue 19, item 2: a store that cannot write refuses each write at once, and its WAL
checkpointer backs off instead of spinning.

Real faults, no mocks: a 1 MiB tmpfs filled up (SQLITE_FULL), the database and its
WAL made immutable with ``chattr +i`` (SQLITE_IOERR, then SQLITE_READONLY on the
writer's fresh connection), and ``max_page_count`` (SQLITE_FULL, without root).

The checkpointer is judged by its attempts as they happen (each one's start, seen
on its own thread) and by its log records, never by CPU time or by how long
something took: after a failure the next checkpoint comes no sooner than its
back-off, which doubles up to a cap, so the gaps between failed attempts are
bounded from below however fast or slow the machine is. The checkpointer that
retried at once failed hundreds of thousands of times a minute, a log record each,
and held the writer so that every write hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from store_backends import Backend
from support import writes_fail, writes_succeed

import torpor.store.sqlite.checkpoint as checkpoint_module
from torpor import StoreUnavailable
from torpor.events import AssistantMessage, UserMessage
from torpor.store import Checkpoint, ModelCall, SQLiteStore

BIG = "words that take room " * 1000  # ~20 KB: each write needs new pages
NOISE = os.urandom(40_000)  # an artifact that compression cannot shrink into a spare page
FIRST, CAP = 0.01, 0.08  # the tests' back-off: 10 ms doubling to 80 ms
IN_A_ROW = 8  # failed checkpoints observed in a row (the cap is reached after 4)
HANG = 10  # seconds: a write that takes longer hangs (a refusal takes milliseconds)


# -- what the checkpointer does, and what the store logs -----------------------------------


class Attempts:
    """Every checkpoint started: (``time.monotonic()`` at its start, whether it succeeded).

    Wraps the function that runs ``PRAGMA wal_checkpoint`` on the checkpointer's thread;
    the real one runs, against the real file.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[float, bool]] = []
        self._loop = asyncio.get_running_loop()
        self._want: tuple[int, asyncio.Future[bool]] | None = None
        real = checkpoint_module._wal_checkpoint

        def counted(conn: Any, mode: checkpoint_module.Mode) -> tuple[int, int, int]:
            at = time.monotonic()
            try:
                result = real(conn, mode)
            except BaseException:
                self._note(at, False)
                raise
            self._note(at, True)
            return result

        monkeypatch.setattr(checkpoint_module, "_wal_checkpoint", counted)

    def _note(self, at: float, ok: bool) -> None:  # on the checkpointer's thread
        self.seen.append((at, ok))
        want = self._want
        if want is not None and (ok or len(self.failing()) >= want[0]):
            self._loop.call_soon_threadsafe(_settle, want[1], not ok)

    def failing(self) -> list[float]:
        """When each failure since the last success started (the current run of failures)."""
        run: list[float] = []
        for at, ok in reversed(self.seen):
            if ok:
                break
            run.append(at)
        return run[::-1]

    async def wait(self, failures: int) -> bool:
        """Until ``failures`` checkpoints in a row have failed (True), or one succeeds (False)."""
        future: asyncio.Future[bool] = self._loop.create_future()
        self._want = (failures, future)
        try:
            if len(self.failing()) >= failures:
                return True
            with anyio.fail_after(HANG + CAP * failures):
                return await future
        finally:
            self._want = None

    async def success(self) -> None:
        """Until the next checkpoint that succeeds."""
        while await self.wait(1 << 30):
            pass


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class Records(logging.Handler):
    """torpor.store's records: (``time.monotonic()``, event name, the record)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[float, str, logging.LogRecord]] = []
        self._arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:  # on the event loop's thread
        self.seen.append((time.monotonic(), record.getMessage().split(" ", 1)[0], record))
        self._arrived.set()

    async def until(self, event: str) -> logging.LogRecord:
        """The first record named ``event``, once it has been logged."""
        while not (found := self.named(event)):
            self._arrived.clear()
            await self._arrived.wait()
        return found[0]

    def events(self, logger: str, since: float = 0.0, prefix: str = "") -> list[str]:
        return [
            event for at, event, r in self.seen
            if r.name == logger and at >= since and event.startswith(prefix)
        ]

    def named(self, event: str) -> list[logging.LogRecord]:
        return [r for _, name, r in self.seen if name == event]


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("torpor.store")
    handler = Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the recoveries and reconnections are info
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


CHECKPOINTER = "torpor.store.sqlite.checkpoint"
WRITER = "torpor.store.sqlite.writer"


# -- the faults ----------------------------------------------------------------------------


class Fault:
    """A real condition under which the database cannot write, and its end."""

    stops_checkpoints = True  # checkpoints fail too (not so for max_page_count)

    def __init__(self, directory: Path) -> None:
        self.path = directory / "log.db"

    async def start(self, store: SQLiteStore) -> None:
        raise NotImplementedError

    async def clear(self, store: SQLiteStore) -> None:
        raise NotImplementedError


class FullDisk(Fault):
    """The tmpfs the database lives on fills up; deleting the filler gives the space back."""

    async def start(self, store: SQLiteStore) -> None:
        filler = self.path.parent / "filler"
        with contextlib.suppress(OSError), filler.open("ab") as out:  # take what is left
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        for size in (20_000, 2_000, 200, 0):  # then whatever room the database still had
            for _ in range(200):
                try:
                    await store.append("~filler", [UserMessage("f" * size)])
                except StoreUnavailable:
                    break

    async def clear(self, store: SQLiteStore) -> None:
        (self.path.parent / "filler").unlink()


class Immutable(Fault):
    """The database file and its WAL get the immutable attribute (refused even to root)."""

    def __init__(self, directory: Path, set_immutable: Callable[[list[Path], bool], None]) -> None:
        super().__init__(directory)
        self._set = set_immutable
        self._files = [self.path, Path(f"{self.path}-wal")]  # not -shm: it is mapped

    async def start(self, store: SQLiteStore) -> None:
        for _ in range(20):
            await store.append("~dirty", [UserMessage("leaves the WAL to checkpoint")])
            self._set(self._files, True)
            if os.stat(self._files[1]).st_size:  # not truncated in between: there is work
                return
            self._set(self._files, False)
        raise AssertionError("the WAL was truncated every time before it became immutable")

    async def clear(self, store: SQLiteStore) -> None:
        self._set(self._files, False)


class PageLimit(Fault):
    """``max_page_count``: the writer's connection may not grow the file (checkpoints may)."""

    stops_checkpoints = False

    async def start(self, store: SQLiteStore) -> None:
        await writes_fail(store)

    async def clear(self, store: SQLiteStore) -> None:
        await writes_succeed(store)


@pytest.fixture(params=["full-disk", "immutable", "page-limit"])
def fault(request: pytest.FixtureRequest, tmp_path: Path) -> Fault:
    if request.param == "full-disk":
        return FullDisk(request.getfixturevalue("tiny_filesystem"))
    if request.param == "immutable":
        return Immutable(tmp_path, request.getfixturevalue("immutable"))
    return PageLimit(tmp_path)


def opened(fault: Fault, durability: str = "normal") -> SQLiteStore:
    """A store whose checkpointer wants to work at once (passive and idle checkpoints
    every 50 ms) and backs off from FIRST to CAP."""
    store = SQLiteStore(
        str(fault.path),
        durability=durability,  # type: ignore[arg-type]
        checkpoint_interval=0.05,
        idle_checkpoint=0.05,
    )
    store._checkpoints = dataclasses.replace(store._checkpoints, retry_first=FIRST, retry_cap=CAP)
    return store


async def broken(store: SQLiteStore, fault: Fault, attempts: Attempts) -> None:
    """Start ``fault``; where it stops checkpoints, until IN_A_ROW of them failed in a row.

    A checkpoint that still succeeds (it found the room it needed, and emptied the WAL,
    which gives back room) means the disk was not full yet: fill it again.
    """
    for _ in range(10):
        await fault.start(store)
        if not fault.stops_checkpoints or await attempts.wait(IN_A_ROW):
            return
    raise AssertionError("checkpoints kept succeeding")


# -- the checkpointer ----------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["full-disk", "immutable"], indirect=True)
async def test_failing_checkpoints_back_off_and_log_once(
    fault: Fault, monkeypatch: pytest.MonkeyPatch, records: Records
) -> None:
    attempts = Attempts(monkeypatch)
    async with opened(fault) as store:
        await store.append("c", [UserMessage("before the trouble")])
        await broken(store, fault, attempts)
        run = attempts.failing()
        assert len(run) >= IN_A_ROW
        # The next attempt waits out the back-off: 10, 20, 40, 80, 80… ms (never at once).
        for j, (before, after) in enumerate(itertools.pairwise(run)):
            wait = min(FIRST * 2**j, CAP)
            assert after - before >= wait - 1e-3, (j, after - before, wait)
        # One record for the whole episode so far, however many attempts failed.
        assert records.events(CHECKPOINTER, since=run[0]) == ["checkpoint_failed"]
        assert "Error(" in records.named("checkpoint_failed")[-1].getMessage()  # the cause

        # Writes are refused at once meanwhile (the checkpointer does not keep the
        # writer), and refused writes log once too (one reconnection, on immutable).
        refused_at = time.monotonic()
        for i in range(5):
            with anyio.fail_after(HANG), pytest.raises(StoreUnavailable):
                await store.append("c", [UserMessage(f"{i} {BIG}")])
        assert store.unavailable_since is not None
        assert records.events(WRITER, since=refused_at).count("group_commit_failed") <= 1
        assert records.events(WRITER, since=refused_at).count("writer_reconnected") <= 1

        await fault.clear(store)
        with anyio.fail_after(HANG):  # no reopen needed
            assert await store.append("c", [UserMessage("after")]) == [1]
            await attempts.success()  # checkpoints succeed again too
            recovered = await records.until("checkpoint_recovered")
        assert store.unavailable_since is None
        assert [e.body for e in await store.read_since("c", 0)] == [
            UserMessage("before the trouble"), UserMessage("after")
        ]
    assert len(records.named("checkpoint_recovered")) == 1
    assert recovered.failures >= IN_A_ROW  # type: ignore[attr-defined]
    checkpoint_records = records.events(CHECKPOINTER)
    assert len(checkpoint_records) < 10, checkpoint_records


def test_back_off_is_validated() -> None:
    with pytest.raises(ValueError):
        checkpoint_module.CheckpointPolicy(retry_first=0)
    with pytest.raises(ValueError):
        checkpoint_module.CheckpointPolicy(retry_first=2, retry_cap=1)


# -- every write path ----------------------------------------------------------------------


def call(conversation: str, turn: int, index: int) -> ModelCall:
    """An audit row big enough to need pages of its own."""
    return ModelCall(
        conversation, turn, index, 0, BIG.encode(), "h", {"tail": 1}, 10, 0.1
    )


WRITES: dict[str, Callable[[SQLiteStore, int], Any]] = {
    "append": lambda s, head: s.append("c", [UserMessage(BIG)], expect_head=head),
    "append_with_key": lambda s, head: s.append_events("c", [UserMessage(BIG)], key="k-1"),
    "put_checkpoint": lambda s, head: s.put_checkpoint(Checkpoint("c", head + 1, 0, 1, (), BIG)),
    "record_model_call": lambda s, head: s.record_model_call(call("c", 1, 7)),
    "answer_and_audit": lambda s, head: s._append_audited(
        "c", [AssistantMessage(BIG)], 1, head, call("c", 1, 8)
    ),
    "put_artifact": lambda s, head: s.put_artifact("c", NOISE),
    "new_conversation": lambda s, head: s.append("new", [UserMessage(BIG)]),
}


@pytest.mark.parametrize("durability", ["normal", "full"])  # small batches inline, or not
async def test_every_write_is_refused_whole_at_once_then_accepted(
    fault: Fault, durability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = Attempts(monkeypatch)
    async with opened(fault, durability) as store:
        writer = store._write()
        await store.append("c", [UserMessage("before the trouble")])
        await store.record_model_call(call("c", 0, 0))
        acked = [UserMessage("before the trouble")]
        head = 0
        await broken(store, fault, attempts)
        inline = writer.inline_batches

        for name, write in WRITES.items():  # each alone: a batch of one
            with anyio.fail_after(HANG):
                (outcome,) = await asyncio.gather(write(store, head), return_exceptions=True)
            assert isinstance(outcome, StoreUnavailable), (name, outcome)
        with anyio.fail_after(HANG):  # all at once, one batch: past INLINE_OPS, on the thread
            outcomes = await asyncio.gather(
                *(write(store, head) for write in WRITES.values()),
                *(store.append(f"more-{i}", [UserMessage(BIG)]) for i in range(4)),
                return_exceptions=True,
            )
        assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
        if durability == "normal":
            assert writer.inline_batches > inline  # the loop's own path was taken
        else:
            assert writer.inline_batches == 0

        # Nothing of any of them is stored; every read still works.
        assert await store.head("c") == head
        assert await store.head("new") is None and await store.head("more-0") is None
        assert len(await store.model_calls("c")) == 1
        assert await store.latest_checkpoint("c") is None
        assert (await store.resume("c")).head == head
        assert await store.search("c", "trouble") != []

        await fault.clear(store)
        with anyio.fail_after(HANG):  # the same store writes again, by itself
            assert await store.append("c", [UserMessage(BIG)], expect_head=head) == [1]
            keyed = await store.append_events("c", [UserMessage(BIG)], key="k-1")
            assert [e.position for e in keyed] == [2]  # stored now, not a replay of a part
            again = await store.append_events("c", [UserMessage(BIG)], key="k-1")
            assert [e.position for e in again] == [2]  # and only once
            await store.put_checkpoint(Checkpoint("c", 3, 0, 1, (), BIG))
            await store.record_model_call(call("c", 1, 7))
            answer = await store._append_audited(
                "c", [AssistantMessage(BIG)], 1, 2, call("c", 1, 8)
            )
            assert [e.position for e in answer] == [3]
        acked += [UserMessage(BIG), UserMessage(BIG), AssistantMessage(BIG)]
        assert [e.body for e in await store.read_since("c", 0)] == acked
        assert [(m.turn, m.call_index) for m in await store.model_calls("c")] == [
            (0, 0), (1, 7), (1, 8)
        ]
        latest = await store.latest_checkpoint("c")
        assert latest is not None and latest.position == 3


# -- the writer's log ----------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["page-limit"], indirect=True)
async def test_refused_batches_log_once_per_episode(fault: Fault, records: Records) -> None:
    async with opened(fault) as store:
        await store.append("c", [UserMessage("before the trouble")])
        await fault.start(store)
        started = time.monotonic()
        for i in range(20):
            with pytest.raises(StoreUnavailable):
                await store.append("c", [UserMessage(f"{i} {BIG}")])
        since = store.unavailable_since
        assert since is not None and since <= started
        # The episode began while the filler took the last room, with one record (an
        # error); the 20 refusals since added none.
        assert records.events(WRITER, since=started, prefix="group_commit") == []
        assert records.named("group_commit_failed")[-1].levelno == logging.ERROR

        await fault.clear(store)
        assert await store.append("c", [UserMessage("after")]) == [1]
        assert store.unavailable_since is None
    assert records.events(WRITER, since=started, prefix="group_commit") == [
        "group_commit_recovered"
    ]
    assert records.named("group_commit_recovered")[-1].failures >= 20  # type: ignore[attr-defined]


postgres = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


@postgres
async def test_postgres_refused_batches_log_once_per_episode(
    backend: Backend, records: Records
) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("before the trouble")])
        await backend.sql(
            "CREATE FUNCTION no_space() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING ERRCODE = 'disk_full'; END $$"
        )
        await backend.sql(
            "CREATE TRIGGER no_space BEFORE INSERT ON events "
            "FOR EACH STATEMENT EXECUTE FUNCTION no_space()"
        )
        for i in range(20):  # each one drops the writer's connection: it reconnects
            with anyio.fail_after(HANG), pytest.raises(StoreUnavailable):
                await store.append("c", [UserMessage(f"refused {i}")])
        assert store.unavailable_since is not None  # type: ignore[attr-defined]
        assert len(records.named("group_commit_failed")) == 1
        assert len(records.named("writer_reconnect")) <= 1
        await backend.sql("DROP TRIGGER no_space ON events")
        assert await store.append("c", [UserMessage("after")]) == [1]
        assert store.unavailable_since is None  # type: ignore[attr-defined]
    (recovered,) = records.named("group_commit_recovered")
    assert recovered.failures == 20  # type: ignore[attr-defined]
