"""The schedule reads on PostgreSQL (see :mod:`torpor.store.schedules`), by an index (the
due index, a conversation's, or the id); with ``shards``, only the rows of those shards
(and rows with no shard, which the caller places by id)."""

from __future__ import annotations

from typing import Any, Protocol

from torpor.store.schedules import Schedule, to_schedule

__all__ = ["conversation_schedules", "due_schedules", "list_schedules", "next_due"]


class Reader(Protocol):
    async def fetch(self, query: str, *args: Any) -> list[Any]: ...


_SELECT = (
    "SELECT s.id, c.external_id, s.due, s.text, s.every, s.key, s.created_at, s.fired, c.shard "
    "FROM schedules AS s JOIN conversations AS c ON c.key = s.conversation_id"
)
_OF = (
    f"{_SELECT} WHERE s.conversation_id = (SELECT key FROM conversations WHERE external_id = $1)"
    " AND s.due IS NOT NULL ORDER BY s.due, s.id"
)
_LIST = f"{_SELECT} WHERE s.due IS NOT NULL AND s.id > $1 ORDER BY s.id LIMIT $2"
_DUE = (
    f"{_SELECT} WHERE s.due IS NOT NULL AND s.due <= $1 AND (s.due, s.id) > ($2, $3)"
    " ORDER BY s.due, s.id LIMIT $4"
)
_DUE_IN = (
    f"{_SELECT} WHERE s.due IS NOT NULL AND s.due <= $1 AND (s.due, s.id) > ($2, $3)"
    " AND (c.shard = ANY($5::int[]) OR c.shard IS NULL) ORDER BY s.due, s.id LIMIT $4"
)
_NEXT = (
    "SELECT s.due, c.external_id, c.shard FROM schedules AS s JOIN conversations AS c "
    "ON c.key = s.conversation_id WHERE s.due IS NOT NULL AND s.due > $1 "
    "ORDER BY s.due, s.id LIMIT $2"
)
_NEXT_IN = (
    "SELECT s.due, c.external_id, c.shard FROM schedules AS s JOIN conversations AS c "
    "ON c.key = s.conversation_id WHERE s.due IS NOT NULL AND s.due > $1 "
    "AND (c.shard = ANY($3::int[]) OR c.shard IS NULL) ORDER BY s.due, s.id LIMIT $2"
)


def _schedule(row: Any) -> Schedule:
    return to_schedule(tuple(row)[:8])


async def conversation_schedules(db: Reader, name: str) -> list[Schedule]:
    return [_schedule(row) for row in await db.fetch(_OF, name)]


async def list_schedules(db: Reader, after: str, limit: int) -> list[Schedule]:
    return [_schedule(row) for row in await db.fetch(_LIST, after, limit)]


async def due_schedules(
    db: Reader, until: int, cursor: tuple[int, str], limit: int, shards: list[int] | None
) -> list[tuple[Schedule, int | None]]:
    if shards is None:
        rows = await db.fetch(_DUE, until, cursor[0], cursor[1], limit)
    else:
        rows = await db.fetch(_DUE_IN, until, cursor[0], cursor[1], limit, shards)
    return [(_schedule(row), row[8]) for row in rows]


async def next_due(
    db: Reader, after: int, limit: int, shards: list[int] | None
) -> list[tuple[int, str, int | None]]:
    if shards is None:
        rows = await db.fetch(_NEXT, after, limit)
    else:
        rows = await db.fetch(_NEXT_IN, after, limit, shards)
    return [(int(r[0]), r[1], r[2]) for r in rows]
