"""The schedule reads on SQLite (see :mod:`torpor.store.schedules`): each one statement on
a reader connection, by an index (the due index, a conversation's, or the id)."""

from __future__ import annotations

import sqlite3

from torpor.store.schedules import Schedule, to_schedule

__all__ = ["conversation_schedules", "due_schedules", "list_schedules", "next_due"]

_SELECT = (
    "SELECT s.id, c.external_id, s.due, s.text, s.every, s.key, s.created_at, s.fired "
    "FROM schedules AS s JOIN conversations AS c ON c.key = s.conversation_id"
)
_OF = (
    f"{_SELECT} WHERE s.conversation_id = (SELECT key FROM conversations WHERE external_id = ?)"
    " AND s.due IS NOT NULL ORDER BY s.due, s.id"
)
_LIST = f"{_SELECT} WHERE s.due IS NOT NULL AND s.id > ? ORDER BY s.id LIMIT ?"
_DUE = (
    f"{_SELECT} WHERE s.due IS NOT NULL AND s.due <= ? AND (s.due > ? OR (s.due = ? AND s.id > ?))"
    " ORDER BY s.due, s.id LIMIT ?"
)
_NEXT = (
    "SELECT s.due, c.external_id FROM schedules AS s JOIN conversations AS c "
    "ON c.key = s.conversation_id WHERE s.due IS NOT NULL AND s.due > ? "
    "ORDER BY s.due, s.id LIMIT ?"
)


def conversation_schedules(conn: sqlite3.Connection, name: str) -> list[Schedule]:
    return [to_schedule(row) for row in conn.execute(_OF, (name,))]


def list_schedules(conn: sqlite3.Connection, after: str, limit: int) -> list[Schedule]:
    return [to_schedule(row) for row in conn.execute(_LIST, (after, limit))]


def due_schedules(
    conn: sqlite3.Connection, until: int, cursor: tuple[int, str], limit: int,
    shards: list[int] | None,
) -> list[tuple[Schedule, int | None]]:
    """Pending schedules due at ``until`` or before, after ``cursor`` (due, id), by (due,
    id); no shard column here (one node): each row's shard None."""
    rows = conn.execute(_DUE, (until, cursor[0], cursor[0], cursor[1], limit))
    return [(to_schedule(row), None) for row in rows]


def next_due(
    conn: sqlite3.Connection, after: int, limit: int, shards: list[int] | None
) -> list[tuple[int, str, int | None]]:
    """(due, conversation, shard) of the first ``limit`` pending schedules due after
    ``after``, soonest first."""
    return [(int(due), name, None) for due, name in conn.execute(_NEXT, (after, limit))]
