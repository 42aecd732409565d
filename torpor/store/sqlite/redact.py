"""Redacting one event on SQLite, with its text gone from every file of the store.

Runs on the writer connection with the writer held, in one transaction (what goes:
:mod:`torpor.store.redact`); then a TRUNCATE checkpoint empties the WAL, as after a
delete (:mod:`.delete`): ``secure_delete`` zeroes the old body's cell and every row
freed, and the full-text entry is removed with FTS5's ``delete`` (merged away in the
same transaction before SQLite 3.42, removed at once from 3.42).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import msgspec

from torpor.errors import InvalidInput, UnknownConversation
from torpor.events import Body, decode_body, encode_body, stand_in
from torpor.store.erase import full_text, indexed_text
from torpor.store.listing import Deletion
from torpor.store.memory import LedgerEntry
from torpor.store.memory_rows import decode_row
from torpor.store.redact import redaction, stale_entry, stale_topic, title_of
from torpor.store.rows import decode_model_call, encode_model_call
from torpor.store.sqlite.delete import SECURE_FTS

__all__ = ["redact_event"]

_EVENT = "SELECT turn, body FROM events WHERE conversation_id = ? AND position = ?"


def redact_event(
    conn: sqlite3.Connection, name: str, position: int, reason: str, now: int,
    count: Callable[[Body], int],
) -> Deletion | None:
    """Redact ``position`` of ``name`` in one transaction; the audit row, or None when it
    was redacted already with this reason. UnknownConversation, InvalidInput (no such
    position, a kind with no content, redacted with another reason): nothing written."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        deletion = _redact(conn, name, position, reason, now, count)
        if deletion is None:
            conn.execute("ROLLBACK")
        else:
            conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return deletion


def _redact(
    conn: sqlite3.Connection, name: str, position: int, reason: str, now: int,
    count: Callable[[Body], int],
) -> Deletion | None:
    row = conn.execute("SELECT key, title FROM conversations WHERE external_id = ?",
                       (name,)).fetchone()
    if row is None:
        raise UnknownConversation(f"conversation {name!r} has no events")
    key, title = int(row[0]), row[1]
    found = conn.execute(_EVENT, (key, position)).fetchone()
    if found is None:
        raise InvalidInput("position", f"{name!r} has no event at {position}")
    turn, data = int(found[0]), bytes(found[1])
    body = decode_body(data, conversation_id=name, position=position)
    redacted = redaction(body, position, reason, now)
    if redacted is None:
        return None
    if SECURE_FTS:
        conn.execute("INSERT INTO events_fts (events_fts, rank) VALUES ('secure-delete', 1)")
    counts: dict[str, int] = {"position": position, "events": 1}
    artifact_id = getattr(body, "artifact", None)
    artifact: bytes | None = None
    if artifact_id:
        got = conn.execute("SELECT data FROM artifacts WHERE id = ?", (artifact_id,)).fetchone()
        artifact = None if got is None else bytes(got[0])
    text = indexed_text(body, artifact)
    rowid = (key << 32) | position
    fts = conn.execute("DELETE FROM fts_backlog WHERE rowid = ?", (rowid,)).rowcount
    if not fts and text:  # indexed already (an event with no text never was)
        conn.execute(
            "INSERT INTO events_fts (events_fts, rowid, text) VALUES ('delete', ?, ?)",
            (rowid, text),
        )
        fts = 1
        if not SECURE_FTS:
            conn.execute("INSERT INTO events_fts (events_fts) VALUES ('optimize')")
    counts["events_fts"] = fts
    counts["artifacts"] = conn.execute(
        "DELETE FROM artifacts WHERE id = ?", (artifact_id,)
    ).rowcount if artifact_id else 0
    encoded = encode_body(redacted)
    conn.execute(
        "UPDATE events SET body = ?, kind = 'redacted', hints = NULL, tokens = ? "
        "WHERE conversation_id = ? AND position = ?",
        (encoded, count(stand_in(redacted)), key, position),
    )
    counts["event_vectors"] = conn.execute(
        "DELETE FROM event_vectors WHERE conversation_id = ? AND position = ?", (key, position)
    ).rowcount
    _folds(conn, name, key, position, counts)
    counts["model_calls"] = _topics(conn, name, key, turn, full_text(body, artifact))
    new_title = title
    if title is not None and title == title_of(body):
        new_title = ""
    conn.execute(
        "UPDATE conversations SET bytes = max(0, bytes - ? + ?), title = ? WHERE key = ?",
        (len(data), len(encoded), new_title, key),
    )
    cursor = conn.execute(
        "INSERT INTO deletions (at, by, conversations, rows) VALUES (?, 'redact', ?, ?)",
        (now, msgspec.json.encode([name]).decode(), msgspec.json.encode(counts).decode()),
    )
    return Deletion(int(cursor.lastrowid or 0), (name,), counts, now, "redact")


def _folds(
    conn: sqlite3.Connection, name: str, key: int, position: int, counts: dict[str, int]
) -> None:
    """Drop the folds that covered ``position`` (checkpoints after it), their memory
    items and the ledger decisions naming those items."""
    counts["checkpoints"] = conn.execute(
        "DELETE FROM checkpoints WHERE conversation_id = ? AND position > ?", (key, position)
    ).rowcount
    if counts["checkpoints"]:
        conn.execute(
            "UPDATE conversations SET checkpoint_position = (SELECT position FROM checkpoints "
            "WHERE conversation_id = ? ORDER BY id DESC LIMIT 1) WHERE key = ?",
            (key, key),
        )
    for table in ("memory_episodes", "memory_facts"):
        counts[table] = conn.execute(
            f"DELETE FROM {table} WHERE conversation_id = ? AND position > ?", (key, position)
        ).rowcount
    stale = [
        int(i) for i, data in conn.execute(
            "SELECT id, body FROM memory_ledger WHERE conversation_id = ?", (key,)
        ).fetchall()
        if stale_entry(decode_row(LedgerEntry, name, int(i), bytes(data)), position)
    ]
    conn.executemany("DELETE FROM memory_ledger WHERE id = ?", [(i,) for i in stale])
    counts["memory_ledger"] = len(stale)


def _topics(conn: sqlite3.Connection, name: str, key: int, turn: int, text: str) -> int:
    """Clear the topic label of model calls (of this turn on) that took it from ``text``."""
    changed: list[tuple[bytes, int]] = []
    for row_id, row_turn, data in conn.execute(
        "SELECT id, turn, body FROM model_calls WHERE conversation_id = ? AND turn >= ?",
        (key, turn),
    ).fetchall():
        call = decode_model_call(name, int(row_turn), bytes(data))
        if stale_topic(call.topic, text):
            cleared = msgspec.structs.replace(call, topic=None, topic_changed=None)
            changed.append((encode_model_call(cleared), int(row_id)))
    conn.executemany("UPDATE model_calls SET body = ? WHERE id = ?", changed)
    return len(changed)
