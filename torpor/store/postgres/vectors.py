"""Hybrid recall's vectors on PostgreSQL (schema version 4; see :mod:`torpor.store.vectors`).

Vectors are ``real[]``, so the table needs no extension. Where pgvector is
installed in the database (``CREATE EXTENSION vector``), distances are
pgvector's ``<=>`` over the arrays cast to ``vector``; otherwise a dot product
of the unit vectors in SQL (``unnest`` of both arrays): both exact, over one
conversation's vectors of one space.

Vectors are derived and written idempotently (a stored one is kept, the
progress mark only moves forward), so they go through the read pool in their
own short transaction rather than through the log's group commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import asyncpg

from torpor.store.vector_format import Vectors, unit

if TYPE_CHECKING:
    from torpor.store.postgres.store import PostgresStore

__all__ = ["PostgresVectors"]

_KEY = "SELECT key FROM conversations WHERE external_id = $1"
# Not for an event redacted since the embedder read it (its vector holds the text).
_INSERT = (
    "INSERT INTO event_vectors (conversation_id, space, position, vector) "
    "SELECT $1::bigint, $2::text, $3::bigint, $4::real[] WHERE NOT EXISTS (SELECT 1 "
    "FROM events WHERE conversation_id = $1 AND position = $3 AND kind = 'redacted') "
    "ON CONFLICT DO NOTHING"
)
_MOVE = (
    "INSERT INTO vector_progress (conversation_id, space, position) VALUES ($1, $2, $3) "
    "ON CONFLICT (conversation_id, space) DO UPDATE "
    "SET position = greatest(vector_progress.position, excluded.position)"
)
_LAGGING = (
    "SELECT c.external_id, coalesce(p.position, -1) AS mark FROM conversations AS c "
    "LEFT JOIN vector_progress AS p ON p.conversation_id = c.key AND p.space = $1 "
    "WHERE c.head > coalesce(p.position, -1) ORDER BY c.updated_at LIMIT $2"
)
_PROGRESS = (
    "SELECT p.position FROM vector_progress AS p JOIN conversations AS c "
    "ON c.key = p.conversation_id WHERE c.external_id = $1 AND p.space = $2"
)
_NEAREST_SQL = (
    "SELECT v.position, (SELECT sum(a * b) FROM unnest(v.vector, $3::real[]) AS t(a, b)) "
    "AS similarity FROM event_vectors AS v WHERE v.conversation_id = $1 AND v.space = $2 "
    "ORDER BY similarity DESC NULLS LAST LIMIT $4"
)
_NEAREST_PGVECTOR = (
    "SELECT v.position, 1 - (v.vector::vector <=> $3::real[]::vector) AS similarity "
    "FROM event_vectors AS v WHERE v.conversation_id = $1 AND v.space = $2 "
    "ORDER BY similarity DESC LIMIT $4"
)


class PostgresVectors:
    """:class:`~torpor.store.vectors.VectorIndex` over a :class:`PostgresStore`."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self.backend = "sql"
        self._pgvector: bool | None = None  # found out at the first search

    async def lagging(self, space: str, limit: int) -> list[tuple[str, int]]:
        async def run(pool: asyncpg.Pool) -> list[tuple[str, int]]:
            rows = await pool.fetch(_LAGGING, space, limit)
            return [(str(r[0]), int(r[1])) for r in rows]

        return await self._store._reading(run)

    async def put(self, conversation_id: str, space: str, vectors: Vectors, through: int) -> None:
        rows = [(position, unit(vector)) for position, vector in vectors]

        async def run(pool: asyncpg.Pool) -> None:
            async with pool.acquire() as conn, conn.transaction():
                key = await conn.fetchval(_KEY + " FOR SHARE", conversation_id)
                if key is None:  # deleted (its delete holds FOR UPDATE: waited for)
                    return
                if rows:
                    await conn.executemany(_INSERT, [(key, space, p, v) for p, v in rows])
                await conn.execute(_MOVE, key, space, through)

        await self._store._reading(run)

    async def progress(self, conversation_id: str, space: str) -> int:
        async def run(pool: asyncpg.Pool) -> int:
            mark = await pool.fetchval(_PROGRESS, conversation_id, space)
            return -1 if mark is None else int(mark)

        return await self._store._reading(run)

    async def nearest(
        self, conversation_id: str, space: str, query: Sequence[float], k: int
    ) -> list[tuple[int, float]]:
        target = unit(query)

        async def run(pool: asyncpg.Pool) -> list[tuple[int, float]]:
            async with pool.acquire() as conn:
                if self._pgvector is None:
                    self._pgvector = bool(
                        await conn.fetchval("SELECT 1 FROM pg_extension WHERE extname = 'vector'")
                    )
                    self.backend = "pgvector" if self._pgvector else "sql"
                key = await conn.fetchval(_KEY, conversation_id)
                if key is None:
                    return []
                sql = _NEAREST_PGVECTOR if self._pgvector else _NEAREST_SQL
                rows = await conn.fetch(sql, key, space, target, k)
                return [(int(r[0]), float(r[1])) for r in rows]

        return await self._store._reading(run)
