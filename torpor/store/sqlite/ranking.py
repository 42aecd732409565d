"""A search's matching rows on SQLite, in the order both backends rank them.

See :mod:`torpor.store.fulltext`: more of the query's distinct terms first, each
weighted by its :func:`~torpor.store.fulltext.rarity` in the conversation, then
bm25 divided by :func:`~torpor.store.fulltext.length_factor` of the event's stored
size. The terms an event holds are summed in SQL, one ``rowid IN (…)`` subquery
per distinct term (each a single FTS5 doclist read, materialised once), so the
best ``limit`` rows come back without reading every match into Python; how many
of the conversation's events hold each term is counted first (:func:`holding`,
one doclist read per term over the conversation's rowid range).
"""

from __future__ import annotations

import math
import sqlite3

from torpor.store.fulltext import LENGTH_BYTES

__all__ = ["Match", "holding", "matches", "scan_backlog"]

Match = tuple[int, float, float]
"""(rowid, rarity-weighted query terms held, relevance: higher is better)."""

# bm25 is NULL where a row has no score (see _relevance): ranked as 0, after every real
# match. Negated, divided by the length factor: higher is better, as ts_rank.
_FACTOR = f"(1.0 + ln(1.0 + length({{size}}) / {LENGTH_BYTES}))"


def _held(table: str, phrases: int) -> str:
    if phrases <= 1:
        return "1"
    one = (f"(? * (f.rowid IN (SELECT rowid FROM {table} "
           f"WHERE {table} MATCH ? AND rowid BETWEEN ? AND ?)))")
    return " + ".join([one] * phrases)


def _ranked(phrases: int) -> str:
    factor = _FACTOR.format(size="e.body")
    return (
        f"SELECT f.rowid, {_held('events_fts', phrases)} AS held, "
        f"-coalesce(bm25(events_fts), 0.0) / {factor} AS relevance "
        "FROM events_fts AS f JOIN events AS e "
        "ON e.conversation_id = ? AND e.position = f.rowid - ? "
        "WHERE events_fts MATCH ? AND f.rowid BETWEEN ? AND ? "
        "ORDER BY held DESC, relevance DESC LIMIT ?"
    )


def _scratch(phrases: int) -> str:
    factor = _FACTOR.format(size="CAST(f.text AS BLOB)")
    return (
        f"SELECT f.rowid, {_held('scratch', phrases)} AS held, "
        f"-coalesce(bm25(scratch), 0.0) / {factor} AS relevance "
        "FROM scratch AS f WHERE scratch MATCH ? AND f.rowid BETWEEN ? AND ? "
        "ORDER BY held DESC, relevance DESC LIMIT ?"
    )


def _run(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> list[Match]:
    try:
        rows = conn.execute(sql, args).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such function: ln" not in str(exc):
            raise
        # A SQLite built without its math functions: the same logarithm, from Python.
        conn.create_function("ln", 1, math.log, deterministic=True)
        rows = conn.execute(sql, args).fetchall()
    return [(int(rowid), float(held), float(relevance)) for rowid, held, relevance in rows]


def _held_args(
    phrases: list[str], weights: list[float], low: int, high: int
) -> tuple[object, ...]:
    if len(phrases) <= 1:
        return ()
    return tuple(
        arg for phrase, weight in zip(phrases, weights, strict=True)
        for arg in (weight, phrase, low, high)
    )


def holding(conn: sqlite3.Connection, phrases: list[str], key: int) -> list[int]:
    """How many indexed events of conversation ``key`` hold each of ``phrases`` (one
    ``count(*)`` per phrase, in one statement)."""
    if len(phrases) <= 1:
        return [1] * len(phrases)  # one term: every match holds it, its weight ranks nothing
    low = key << 32
    one = "(SELECT count(*) FROM events_fts WHERE events_fts MATCH ? AND rowid BETWEEN ? AND ?)"
    row = conn.execute(
        "SELECT " + ", ".join([one] * len(phrases)),
        tuple(arg for phrase in phrases for arg in (phrase, low, low | 0xFFFFFFFF)),
    ).fetchone()
    return [int(count) for count in row]


def matches(
    conn: sqlite3.Connection,
    expression: str,
    phrases: list[str],
    weights: list[float],
    key: int,
    limit: int,
) -> list[Match]:
    """The best ``limit`` rows of conversation ``key`` matching ``expression`` (the OR of
    ``phrases``, one per distinct term, each counted by its weight), best first."""
    low = key << 32
    high = low | 0xFFFFFFFF
    args = (*_held_args(phrases, weights, low, high), key, low, expression, low, high, limit)
    return _run(conn, _ranked(len(phrases)), args)


_SCRATCH_TABLE = (
    "CREATE VIRTUAL TABLE scratch USING fts5(text, columnsize=0, "
    "tokenize='unicode61 remove_diacritics 2')"
)
"""The scratch index for a backlog searched in place: tokenized as events_fts is (schema
v1), and keeping its text, whose size stands in for the stored body's."""


def scan_backlog(
    conn: sqlite3.Connection,
    expression: str,
    phrases: list[str],
    weights: list[float],
    low: int,
    high: int,
    k: int,
) -> list[Match]:
    """The backlog's rows of one conversation, ranked in a scratch index (see reads.search)."""
    rows = conn.execute(
        "SELECT rowid, text FROM fts_backlog WHERE rowid BETWEEN ? AND ?", (low, high)
    ).fetchall()
    if not rows:
        return []
    scratch = sqlite3.connect(":memory:")
    try:
        scratch.execute(_SCRATCH_TABLE)
        scratch.executemany("INSERT INTO scratch (rowid, text) VALUES (?, ?)", rows)
        args = (*_held_args(phrases, weights, low, high), expression, low, high, k)
        return _run(scratch, _scratch(len(phrases)), args)
    finally:
        scratch.close()
