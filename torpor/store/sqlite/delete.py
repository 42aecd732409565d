"""Deleting a conversation on SQLite, with its bytes gone from every file of the store.

Runs on the writer connection with the writer held (no batch beside it), in one
transaction: the conversation and its sub-agent conversations (:mod:`torpor.store.erase`),
every table's rows, the search backlog's rows, the full-text index entries, and a row
in ``deletions``. Then, still holding the writer, a TRUNCATE checkpoint empties the WAL.

Why the bytes are gone, not just the rows:

* ``secure_delete`` is on for the writer connection (:mod:`.schema`), so every page
  or cell a delete frees is overwritten with zeros, here and in the ordinary deletes
  before (search-backlog flushes, index merges).
* The full-text index is contentless: its entries are removed with FTS5's
  ``delete`` command, given the text each event was indexed with (rebuilt from the
  body, and its artifact for a clipped one). A delete only adds a tombstone; the
  terms stay in older segments until those are merged, so on SQLite before 3.42
  the index is merged into one segment (``optimize``, whose cost grows with the
  whole index) in the same transaction; from 3.42 the table's ``secure-delete``
  option removes them at once.
* The WAL still holds the old pages until a checkpoint copies the new ones over
  and truncates it; the ``-shm`` file holds page numbers only.
"""

from __future__ import annotations

import sqlite3

import msgspec

from torpor.events import decode_body
from torpor.store.erase import KEYED_TABLES, children, indexed_text
from torpor.store.listing import Deletion

__all__ = ["SECURE_FTS", "backlog_size", "delete_tree", "read_deletions", "truncate_wal"]

SECURE_FTS = sqlite3.sqlite_version_info >= (3, 42, 0)
"""FTS5's ``secure-delete`` option exists (else the index is optimized after a delete)."""

_KEY = "SELECT key FROM conversations WHERE external_id = ?"
_SPAWNED = "SELECT position, body FROM events WHERE conversation_id = ? AND kind = 'spawned'"


def _tree(conn: sqlite3.Connection, name: str, key: int) -> list[tuple[str, int]]:
    """The conversation and its sub-agent conversations that exist, parents first."""
    found = [(name, key)]
    seen = {name}
    index = 0
    while index < len(found):
        parent, parent_key = found[index]
        index += 1
        for child in children(parent, conn.execute(_SPAWNED, (parent_key,)).fetchall()):
            if child in seen:
                continue
            seen.add(child)
            row = conn.execute(_KEY, (child,)).fetchone()
            if row is not None:
                found.append((child, int(row[0])))
    return found


def _unindex(conn: sqlite3.Connection, name: str, key: int) -> int:
    """Remove the conversation's full-text entries (index and backlog); how many."""
    low, high = key << 32, ((key + 1) << 32) - 1
    waiting = {
        int(r[0]) for r in conn.execute(
            "SELECT rowid FROM fts_backlog WHERE rowid BETWEEN ? AND ?", (low, high)
        )
    }
    removed = conn.execute(
        "DELETE FROM fts_backlog WHERE rowid BETWEEN ? AND ?", (low, high)
    ).rowcount
    artifacts = dict(
        conn.execute("SELECT id, data FROM artifacts WHERE conversation_id = ?", (key,))
    )
    deletes: list[tuple[int, str]] = []
    for position, data in conn.execute(
        "SELECT position, body FROM events WHERE conversation_id = ?", (key,)
    ):
        rowid = low | int(position)
        if rowid in waiting:
            continue  # only in the backlog, never indexed
        body = decode_body(bytes(data), conversation_id=name, position=int(position))
        artifact_id = getattr(body, "artifact", None)
        text = indexed_text(body, artifacts.get(artifact_id) if artifact_id else None)
        if text:
            deletes.append((rowid, text))
    if deletes:
        deletes.sort()
        conn.executemany(
            "INSERT INTO events_fts (events_fts, rowid, text) VALUES ('delete', ?, ?)", deletes
        )
    return removed + len(deletes)


def delete_tree(conn: sqlite3.Connection, name: str, by: str, now: int) -> Deletion | None:
    """Delete ``name`` and its sub-agent conversations in one transaction; the audit row
    (None, nothing written, when there is no such conversation)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute(_KEY, (name,)).fetchone()
        if row is None:
            conn.execute("ROLLBACK")
            return None
        tree = _tree(conn, name, int(row[0]))
        if SECURE_FTS:
            conn.execute("INSERT INTO events_fts (events_fts, rank) VALUES ('secure-delete', 1)")
        counts: dict[str, int] = {"events_fts": 0, "pending_calls": 0}
        for table in KEYED_TABLES:
            counts[table] = 0
        for conversation, key in tree:
            counts["events_fts"] += _unindex(conn, conversation, key)
            for table in KEYED_TABLES:
                counts[table] += conn.execute(
                    f"DELETE FROM {table} WHERE conversation_id = ?", (key,)
                ).rowcount
            counts["pending_calls"] += conn.execute(
                "DELETE FROM pending_calls WHERE conversation = ?", (conversation,)
            ).rowcount
            conn.execute("DELETE FROM conversations WHERE key = ?", (key,))
        counts["conversations"] = len(tree)
        if counts["events_fts"] and not SECURE_FTS:
            # Tombstones only hide the terms; merging every segment drops them for good.
            conn.execute("INSERT INTO events_fts (events_fts) VALUES ('optimize')")
        names = tuple(conversation for conversation, _ in tree)
        cursor = conn.execute(
            "INSERT INTO deletions (at, by, conversations, rows) VALUES (?, ?, ?, ?)",
            (now, by, msgspec.json.encode(names).decode(), msgspec.json.encode(counts).decode()),
        )
        deletion = Deletion(int(cursor.lastrowid or 0), names, counts, now, by)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return deletion


def backlog_size(conn: sqlite3.Connection) -> tuple[int, int]:
    """The search backlog's (rows, text characters), after a delete took some away."""
    rows, text = conn.execute("SELECT count(*), total(length(text)) FROM fts_backlog").fetchone()
    return int(rows), int(text)


def truncate_wal(conn: sqlite3.Connection) -> bool:
    """Copy the WAL into the database and truncate it (waiting up to the connection's
    busy timeout for readers); whether it was emptied."""
    busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return int(busy) == 0 and int(frames) == int(copied)


def read_deletions(conn: sqlite3.Connection, after: int, limit: int) -> list[Deletion]:
    rows = conn.execute(
        "SELECT id, conversations, rows, at, by FROM deletions WHERE id > ? ORDER BY id LIMIT ?",
        (after, limit),
    )
    return [
        Deletion(int(i), tuple(msgspec.json.decode(c)), msgspec.json.decode(r), int(at), str(by))
        for i, c, r, at, by in rows
    ]
