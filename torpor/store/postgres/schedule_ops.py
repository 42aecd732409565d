"""Adding and cancelling schedules on PostgreSQL (see :mod:`torpor.store.schedules`).

Each is one transaction on a pooled connection beside the group commit (rare
next to appends), fenced on a clustered node as ``describe`` is: the lease epoch
checked ``FOR SHARE`` first. An add locks its conversation row (as an append
does), so a delete cannot land between its check and its insert and two adds
count the pending schedules one after the other. Firing is an append (:mod:`.plan`).
"""

from __future__ import annotations

import asyncpg

from torpor.errors import FencedError, TooManySchedules, UnknownConversation
from torpor.store.schedules import NewSchedule, Schedule, replayed

__all__ = ["add_schedule", "remove_schedule"]

_EPOCH = "SELECT epoch FROM shard_leases WHERE shard = $1 FOR SHARE"
_LOCK = "SELECT key FROM conversations WHERE external_id = $1 FOR UPDATE"
_BY_KEY = (
    "SELECT id, due, every, text, created_at, fired, fingerprint FROM schedules "
    "WHERE conversation_id = $1 AND key = $2"
)
_PENDING = "SELECT count(*) FROM schedules WHERE conversation_id = $1 AND due IS NOT NULL"
_INSERT = (
    "INSERT INTO schedules (id, conversation_id, due, every, text, key, fingerprint, "
    "created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
_OF = "conversation_id = (SELECT key FROM conversations WHERE external_id = $2)"
_DELETE = f"DELETE FROM schedules WHERE id = $1 AND {_OF} AND due IS NOT NULL AND key IS NULL"
_DONE = f"UPDATE schedules SET due = NULL WHERE id = $1 AND {_OF} AND due IS NOT NULL"


async def _fenced(conn: asyncpg.Connection, name: str, fence: tuple[int, int] | None) -> None:
    if fence is not None and await conn.fetchval(_EPOCH, fence[0]) != fence[1]:
        raise FencedError(name, fence[0], fence[1])


async def add_schedule(
    pool: asyncpg.Pool, new: NewSchedule, at_most: int | None, fence: tuple[int, int] | None
) -> Schedule:
    name = new.conversation_id
    async with pool.acquire() as conn, conn.transaction():
        await _fenced(conn, name, fence)
        key = await conn.fetchval(_LOCK, name)
        if key is None:
            raise UnknownConversation(f"conversation {name!r} has no events")
        if new.key is not None:
            row = await conn.fetchrow(_BY_KEY, key, new.key)
            if row is not None:
                sid, due, every, text, created, fired, mark = row
                found = Schedule(
                    sid, name, None if due is None else int(due), text,
                    None if every is None else int(every) / 1000, new.key, int(created),
                    int(fired),
                )
                return replayed(found, new.fingerprint, None if mark is None else bytes(mark))
        if at_most is not None and int(await conn.fetchval(_PENDING, key)) >= at_most:
            raise TooManySchedules(name, at_most)
        await conn.execute(
            _INSERT, new.id, key, new.due, new.every_ms, new.text, new.key, new.fingerprint,
            new.created_at,
        )
    return Schedule(
        new.id, name, new.due, new.text,
        None if new.every_ms is None else new.every_ms / 1000, new.key, new.created_at,
    )


async def remove_schedule(
    pool: asyncpg.Pool, name: str, schedule_id: str, fence: tuple[int, int] | None
) -> bool:
    """Unkeyed: the row goes; keyed: kept, done, for a retry of its key."""
    async with pool.acquire() as conn, conn.transaction():
        await _fenced(conn, name, fence)
        if (await conn.execute(_DELETE, schedule_id, name)).split()[-1] != "0":
            return True
        return bool((await conn.execute(_DONE, schedule_id, name)).split()[-1] != "0")
