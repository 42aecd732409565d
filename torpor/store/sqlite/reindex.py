"""Schema version 9: the full-text index in the normalised form (:mod:`torpor.store.normalise`).

Before version 9 an event was indexed with its searchable text as written; from 9 on,
with its :func:`~torpor.store.normalise.index_form`. The index is contentless and an
entry is removed by giving FTS5 the exact text it was indexed with
(:func:`torpor.store.erase.indexed_text`), so every entry must be in the one form a
delete will rebuild: the migration moves each entry whose text the form changes (an
FTS5 ``delete`` with the old text, an insert of the new), and rewrites the waiting
search backlog's rows the same way. Entries the form leaves alone (ASCII text without
grouped digits: most) are not touched, but every event is read and decoded once: 0.64 s
for 100,000 short events on a loaded 2-core VM (those the form changes cost an FTS5
delete and insert each on top), paid once, at the open that migrates.
"""

from __future__ import annotations

import sqlite3

from torpor.errors import CorruptEvent
from torpor.events import decode_body
from torpor.store.clip import artifact_of
from torpor.store.erase import full_text
from torpor.store.normalise import index_form

__all__ = ["BATCH", "reindex"]

BATCH = 512
"""Entries moved per statement."""


def reindex(conn: sqlite3.Connection) -> None:
    """Every full-text entry (index and backlog) in the form :func:`index_form` gives."""
    waiting: set[int] = set()
    rewritten = []
    for rowid, text in conn.execute("SELECT rowid, text FROM fts_backlog").fetchall():
        waiting.add(int(rowid))
        new = index_form(text)
        if new != text:
            rewritten.append((new, rowid))
    conn.executemany("UPDATE fts_backlog SET text = ? WHERE rowid = ?", rewritten)
    moves: list[tuple[int, str, str]] = []
    rows = conn.execute("SELECT conversation_id, position, body FROM events")
    for key, position, data in rows:
        rowid = (int(key) << 32) | int(position)
        if rowid in waiting:
            continue
        try:
            body = decode_body(bytes(data), conversation_id=str(key), position=int(position))
        except CorruptEvent:
            continue  # read as corrupt elsewhere; its entry stays as it was
        artifact = None
        artifact_id = artifact_of(body)
        if artifact_id:
            found = conn.execute(
                "SELECT data FROM artifacts WHERE id = ?", (artifact_id,)
            ).fetchone()
            artifact = None if found is None else bytes(found[0])
        old = full_text(body, artifact)
        new = index_form(old)
        if new != old:  # (an empty text was never indexed: index_form("") is "")
            moves.append((rowid, old, new))
            if len(moves) >= BATCH:
                _move(conn, moves)
    _move(conn, moves)


def _move(conn: sqlite3.Connection, moves: list[tuple[int, str, str]]) -> None:
    conn.executemany(
        "INSERT INTO events_fts (events_fts, rowid, text) VALUES ('delete', ?, ?)",
        [(rowid, old) for rowid, old, _ in moves],
    )
    conn.executemany(
        "INSERT INTO events_fts (rowid, text) VALUES (?, ?)",
        [(rowid, new) for rowid, _, new in moves],
    )
    moves.clear()
