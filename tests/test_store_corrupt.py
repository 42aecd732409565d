"""A row that does not decode is a typed CorruptEvent naming where it is; never skipped."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_backends import Backend

from torpor import CorruptEvent, CorruptStore, StoreError
from torpor.events import UserMessage
from torpor.store import SQLiteStore


@pytest.mark.parametrize("garbage", [b"\xc1\xff garbage", b"", b"\x81\xa4kind\xa4nope"])
async def test_a_corrupt_body_raises_corrupt_event_with_its_position(
    backend: Backend, garbage: bytes
) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(f"word{i}") for i in range(10)])
    await backend.sql("UPDATE events SET body = ? WHERE position = 6", garbage)
    async with backend.open() as store:
        for read in (
            store.read_since("c", 0),
            store.page_backward("c"),
            store.read_range("c", 5, 7),
            store.resume("c"),
            store.search("c", "word6"),
        ):
            with pytest.raises(CorruptEvent) as caught:
                await read
            assert (caught.value.conversation_id, caught.value.position) == ("c", 6)
        # rows around it still read
        assert [e.position for e in await store.read_since("c", 7)] == [7, 8, 9]
        assert len(await store.page_backward("c", before=6)) == 6


@pytest.mark.parametrize(
    "content", [b"this is not a database at all" * 200, b"SQLite format 3\x00" + b"\xff" * 5000]
)
async def test_a_garbage_file_is_a_corrupt_store_at_open(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(content)
    with pytest.raises(CorruptStore) as caught:
        async with SQLiteStore(str(path)):
            pass
    assert isinstance(caught.value, StoreError)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)


async def _filled(path: Path) -> bytearray:
    async with SQLiteStore(str(path)) as store:
        for i in range(40):
            await store.append(f"c{i}", [UserMessage(f"message {i} " + "x" * 2000)] * 3)
    return bytearray(_contents(path))


def _contents(path: Path) -> bytes:
    assert not path.with_name(path.name + "-wal").exists()  # all of it is in the file
    return path.read_bytes()


async def test_a_truncated_file_is_a_corrupt_store_at_open(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    data = await _filled(path)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptStore):
        async with SQLiteStore(str(path)):
            pass


async def test_damaged_pages_are_a_corrupt_store_on_the_reads_that_meet_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    data = await _filled(path)
    page = int.from_bytes(data[16:18], "big")  # the header's page size (1 means 65536)
    middle = len(data) // 2 // page * page  # whole pages, headers included
    data[middle : middle + 8 * 4096] = b"\xa5" * (8 * 4096)
    path.write_bytes(data)
    async with SQLiteStore(str(path)) as store:
        outcomes = []
        for i in range(40):
            try:
                outcomes.append(len(await store.read_since(f"c{i}", 0)))
            except CorruptStore as exc:  # a damaged b-tree page: SQLite says so
                assert isinstance(exc.__cause__, sqlite3.DatabaseError)
                outcomes.append(-1)
            except CorruptEvent:  # a damaged overflow page of a body: the decoder says so
                outcomes.append(-2)
        assert {-1, -2} & set(outcomes) and 3 in outcomes  # damage typed, the others intact
