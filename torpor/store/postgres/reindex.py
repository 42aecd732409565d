"""Schema version 10: the full-text index in the normalised form (:mod:`torpor.store.normalise`).

Before version 10 an event's documents were built from its searchable text as written;
from 10 on, from its :func:`~torpor.store.normalise.index_form`. The migration rebuilds
the documents of each event whose text the form changes (the others, ASCII text without
grouped digits, are left alone), reading and decoding every event once, inside the
migration's transaction. PostgreSQL removes index rows by key, so an old document would
not break a delete; it is rebuilt so that a query in the new form finds old events too.
"""

from __future__ import annotations

import asyncpg

from torpor.errors import CorruptEvent
from torpor.events import decode_body
from torpor.store.clip import artifact_of
from torpor.store.erase import full_text
from torpor.store.normalise import index_form
from torpor.store.postgres.lexemes import document_chunks

__all__ = ["BATCH", "reindex"]

BATCH = 512
"""Events whose documents are rebuilt per statement."""

_DROP = (
    "DELETE FROM events_fts AS f USING unnest($1::bigint[], $2::bigint[]) AS u(c, p) "
    "WHERE f.conversation_id = u.c AND f.position = u.p"
)
_INSERT = """
    INSERT INTO events_fts (conversation_id, position, chunk, document)
    SELECT c, p, n, CASE WHEN l = '' THEN to_tsvector('simple', t)
        ELSE to_tsvector('simple', t) || array_to_tsvector(string_to_array(l, ' ')) END
    FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::text[], $5::text[])
        AS u(c, p, n, t, l)
"""


async def reindex(conn: asyncpg.Connection) -> None:
    """Rebuild the documents of every event :func:`index_form` changes the text of."""
    moves: list[tuple[int, int, str]] = []
    async for key, position, data in conn.cursor(
        "SELECT conversation_id, position, body FROM events", prefetch=1000
    ):
        try:
            body = decode_body(bytes(data), conversation_id=str(key), position=int(position))
        except CorruptEvent:
            continue  # read as corrupt elsewhere; its documents stay as they were
        artifact = None
        artifact_id = artifact_of(body)
        if artifact_id:
            found = await conn.fetchval("SELECT data FROM artifacts WHERE id = $1", artifact_id)
            artifact = None if found is None else bytes(found)
        old = full_text(body, artifact)
        new = index_form(old)
        if new != old:
            moves.append((int(key), int(position), new))
            if len(moves) >= BATCH:
                await _move(conn, moves)
    await _move(conn, moves)


async def _move(conn: asyncpg.Connection, moves: list[tuple[int, int, str]]) -> None:
    if not moves:
        return
    await conn.execute(_DROP, [k for k, _, _ in moves], [p for _, p, _ in moves])
    rows = [
        (key, position, chunk, text, lexemes)
        for key, position, new in moves
        for chunk, (text, lexemes) in enumerate(document_chunks(new))
    ]
    await conn.execute(_INSERT, *(list(column) for column in zip(*rows, strict=True)))
    moves.clear()
