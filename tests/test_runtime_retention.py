"""Retention (runtime.retention): conversations idle past RuntimeConfig.retention go.

A pass (``rt.expire``) deletes only the conversations whose last activity is older than
the retention, audited ``by="retention"`` and counted; the background sweep the runtime
owns does the same on its own, and stops with the runtime. Activity times are set in the
past through the store's database (no sleeping until they age).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from torpor import ConversationDeleted, InvalidInput, Runtime, RuntimeConfig
from torpor.events import UserMessage
from torpor.runtime.retention import RETENTION_BATCH, interval
from torpor.store.prepare import now_ms

DAY_MS = 86_400_000


def _age(path: Path, days: dict[str, float]) -> None:
    """Move conversations' last activity ``days`` into the past (negative: the future)."""
    with sqlite3.connect(path) as db:
        for name, back in days.items():
            db.execute("UPDATE conversations SET updated_at = updated_at - ? "
                       "WHERE external_id = ?", (int(back * DAY_MS), name))


async def test_a_pass_deletes_only_conversations_idle_past_the_retention(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rt.db"
    async with Runtime(f"sqlite:///{path}") as rt:
        for name in ("old-1", "old-2", "recent", "fresh"):
            await (await rt.send(name, f"hello {name}")).result()
        _age(path, {"old-1": 40, "old-2": 31, "recent": 29})
        with pytest.raises(InvalidInput):
            await rt.expire()  # no RuntimeConfig.retention and no older_than
        assert await rt.expire(30 * 86_400) == 2
        assert sorted(i.id for i in await rt.conversations()) == ["fresh", "recent"]
        assert await rt.history("old-1") == []
        audit = await rt.store.deletions()
        assert sorted((d.conversations, d.by) for d in audit) == [
            (("old-1",), "retention"), (("old-2",), "retention")]
        assert (await rt.admin.stats()).retention_deletions == 2
        assert await rt.expire(30 * 86_400) == 0  # nothing left that old
        # "now" is injectable: two days on, "recent" is past 30 days too.
        assert await rt.expire(30 * 86_400, now=now_ms() + 2 * DAY_MS) == 1
        assert [i.id for i in await rt.conversations()] == ["fresh"]
        assert (await rt.admin.stats()).retention_deletions == 3


async def test_a_pass_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "rt.db"
    async with Runtime(f"sqlite:///{path}") as rt:
        names = [f"c{index}" for index in range(RETENTION_BATCH + 5)]
        for name in names:
            await rt.store.append(name, [UserMessage("hi")])
        _age(path, dict.fromkeys(names, 2))
        assert await rt.expire(86_400) == RETENTION_BATCH
        assert await rt.expire(86_400) == 5
        assert len(await rt.conversations()) == 0


async def test_the_background_sweep_deletes_old_conversations_and_stops_with_the_runtime(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rt.db"
    config = RuntimeConfig(retention=4.0)  # a pass every second
    assert interval(4.0) == 1.0
    async with Runtime(f"sqlite:///{path}", config=config) as rt:
        await (await rt.send("old", "hello old")).result()
        await (await rt.send("kept", "hello kept")).result()
        sweep = next(t for t in asyncio.all_tasks() if t.get_name() == "torpor-retention")
        _age(path, {"old": 1, "kept": -1})  # "kept" active in the future: never due
        follower = rt.subscribe("old", after=-1)
        # The follower's stream ending (ConversationDeleted) is the sync point: no sleep.
        with pytest.raises(ConversationDeleted):
            async with asyncio.timeout(30):  # a guard only: the follower ends at the delete
                async for _ in follower:
                    pass
        assert [i.id for i in await rt.conversations()] == ["kept"]
        assert [d.by for d in await rt.store.deletions()] == ["retention"]
        assert (await rt.admin.stats()).retention_deletions == 1
        assert not sweep.done()
    assert sweep.cancelled()


async def test_by_default_nothing_expires(tmp_path: Path) -> None:
    """RuntimeConfig.retention None (the default): no sweep runs, however old the
    conversation; deleting then takes an explicit call."""
    path = tmp_path / "rt.db"
    assert RuntimeConfig().retention is None
    async with Runtime(f"sqlite:///{path}") as rt:
        await (await rt.send("ancient", "hello")).result()
        _age(path, {"ancient": 3650})
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "torpor-retention"]
        assert [i.id for i in await rt.conversations()] == ["ancient"]
    assert await _deletions(path) == 0


async def _deletions(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM deletions").fetchone()[0])
