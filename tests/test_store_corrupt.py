"""A row that does not decode is a typed CorruptEvent naming where it is; never skipped."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from torpor import CorruptEvent
from torpor.events import UserMessage
from torpor.store import SQLiteStore


@pytest.mark.parametrize("garbage", [b"\xc1\xff garbage", b"", b"\x81\xa4kind\xa4nope"])
async def test_a_corrupt_body_raises_corrupt_event_with_its_position(
    tmp_path: Path, garbage: bytes
) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore(str(path)) as store:
        await store.append("c", [UserMessage(str(i)) for i in range(10)])
    raw = sqlite3.connect(path)
    raw.execute("UPDATE events SET body = ? WHERE position = 6", (garbage,))
    raw.commit()
    raw.close()
    async with SQLiteStore(str(path)) as store:
        for read in (
            store.read_since("c", 0),
            store.page_backward("c"),
            store.read_range("c", 5, 7),
            store.resume("c"),
        ):
            with pytest.raises(CorruptEvent) as caught:
                await read
            assert (caught.value.conversation_id, caught.value.position) == ("c", 6)
        # rows around it still read
        assert [e.position for e in await store.read_since("c", 7)] == [7, 8, 9]
        assert len(await store.page_backward("c", before=6)) == 6
