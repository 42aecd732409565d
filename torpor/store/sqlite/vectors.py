"""Hybrid recall's vectors on SQLite (schema version 5; see :mod:`torpor.store.vectors`).

Writes go through the group-commit writer like every other write (one writer
connection; a vector batch is one operation in a commit). Searches run on a
reader's thread: with ``sqlite-vec`` loaded there, SQLite computes the cosine
distances (``vec_distance_cosine``) and returns only the ``k`` nearest; without
it (the extra is not installed, or this Python's sqlite3 cannot load
extensions) the same exact search runs in Python on that thread.
"""

from __future__ import annotations

import heapq
import operator
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from torpor._logging import get_logger
from torpor.store.sqlite.batch import Batch, Plan
from torpor.store.vector_format import Vectors, from_blob, to_blob, unit

if TYPE_CHECKING:
    from torpor.store.sqlite.store import SQLiteStore

__all__ = ["SQLiteVectors", "VectorOp", "load_sqlite_vec"]

log = get_logger(__name__)

# Not for an event redacted since the embedder read it (its vector holds the text).
_INSERT_VECTOR = (
    "INSERT OR IGNORE INTO event_vectors (conversation_id, space, position, vector) "
    "SELECT ?1, ?2, ?3, ?4 WHERE NOT EXISTS (SELECT 1 FROM events "
    "WHERE conversation_id = ?1 AND position = ?3 AND kind = 'redacted')"
)
_MOVE_PROGRESS = (
    "INSERT INTO vector_progress (conversation_id, space, position) VALUES (?, ?, ?) "
    "ON CONFLICT (conversation_id, space) DO UPDATE "
    "SET position = max(position, excluded.position)"
)
_LAGGING = (
    "SELECT c.external_id, coalesce(p.position, -1) FROM conversations AS c "
    "LEFT JOIN vector_progress AS p ON p.conversation_id = c.key AND p.space = ? "
    "WHERE c.head > coalesce(p.position, -1) ORDER BY c.updated_at LIMIT ?"
)
_PROGRESS = (
    "SELECT p.position FROM vector_progress AS p JOIN conversations AS c "
    "ON c.key = p.conversation_id WHERE c.external_id = ? AND p.space = ?"
)
_KEY = "SELECT key FROM conversations WHERE external_id = ?"
_NEAREST_VEC = (
    "SELECT position, 1.0 - vec_distance_cosine(vector, ?) AS similarity FROM event_vectors "
    "WHERE conversation_id = ? AND space = ? ORDER BY similarity DESC LIMIT ?"
)
_ALL = "SELECT position, vector FROM event_vectors WHERE conversation_id = ? AND space = ?"


def load_sqlite_vec(conn: sqlite3.Connection) -> bool:
    """Load sqlite-vec into ``conn`` (on its thread); False when it cannot be loaded."""
    enable = getattr(conn, "enable_load_extension", None)
    if enable is None:  # this Python's sqlite3 was built without extension loading
        return False
    try:
        import sqlite_vec  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return False
    try:
        enable(True)
        try:
            sqlite_vec.load(conn)
        finally:
            enable(False)
    except sqlite3.Error as exc:
        log.warning("sqlite_vec_unavailable", error=str(exc))
        return False
    return True


class VectorOp(msgspec.Struct, frozen=True, gc=False):
    """Store one conversation's new vectors and move its progress mark, in one commit."""

    conversation_id: str
    space: str
    rows: tuple[tuple[int, bytes], ...]
    through: int

    def plan(self, batch: Batch) -> Plan:
        state = batch.conversation(self.conversation_id)
        if not state.stored:  # no such conversation: nothing to hang vectors on
            return Plan(None)
        key, space = state.key, self.space
        writes: list[tuple[str, tuple[object, ...]]] = [
            (_INSERT_VECTOR, (key, space, position, blob)) for position, blob in self.rows
        ]
        writes.append((_MOVE_PROGRESS, (key, space, self.through)))
        return Plan(None, writes=writes)


def _lagging(conn: sqlite3.Connection, space: str, limit: int) -> list[tuple[str, int]]:
    return [(str(name), int(mark)) for name, mark in conn.execute(_LAGGING, (space, limit))]


def _progress(conn: sqlite3.Connection, name: str, space: str) -> int:
    row = conn.execute(_PROGRESS, (name, space)).fetchone()
    return -1 if row is None else int(row[0])


def _has_vec(conn: sqlite3.Connection, try_loading: bool) -> bool:
    """sqlite-vec is loaded in ``conn`` (loaded now if ``try_loading``)."""
    try:
        conn.execute("SELECT vec_version()")
    except sqlite3.OperationalError:
        return try_loading and load_sqlite_vec(conn)
    return True


def _nearest(
    conn: sqlite3.Connection, name: str, space: str, query: bytes, k: int, try_vec: bool
) -> tuple[list[tuple[int, float]], bool]:
    row = conn.execute(_KEY, (name,)).fetchone()
    vec = _has_vec(conn, try_vec)
    if row is None:
        return [], vec
    key = int(row[0])
    if vec:
        found = conn.execute(_NEAREST_VEC, (query, key, space, k)).fetchall()
        return [(int(p), float(s)) for p, s in found], True
    target = from_blob(query)
    mul = operator.mul
    scored = (
        (sum(map(mul, from_blob(blob), target)), int(position))
        for position, blob in conn.execute(_ALL, (key, space))
    )
    best = heapq.nlargest(k, scored)
    return [(position, float(similarity)) for similarity, position in best], False


class SQLiteVectors:
    """:class:`~torpor.store.vectors.VectorIndex` over a :class:`SQLiteStore`."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self.backend = "python"  # until a search finds sqlite-vec loaded
        self._try_vec = True  # False once a connection could not load it: none can

    async def lagging(self, space: str, limit: int) -> list[tuple[str, int]]:
        return await self._store._reading(_lagging, space, limit)

    async def put(self, conversation_id: str, space: str, vectors: Vectors, through: int) -> None:
        rows = tuple((position, to_blob(unit(vector))) for position, vector in vectors)
        await self._store._submit(VectorOp(conversation_id, space, rows, through))

    async def progress(self, conversation_id: str, space: str) -> int:
        return await self._store._reading(_progress, conversation_id, space)

    async def nearest(
        self, conversation_id: str, space: str, query: Sequence[float], k: int
    ) -> list[tuple[int, float]]:
        blob = to_blob(unit(query))
        found, vec = await self._store._reading(
            _nearest, conversation_id, space, blob, k, self._try_vec
        )
        self.backend = "sqlite-vec" if vec else "python"
        self._try_vec = vec
        return found
