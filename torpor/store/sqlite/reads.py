"""The read side, as it runs on a reader connection's thread (one hop per public call).

Reads that need more than one statement (resume, search, pending) wrap them in
one deferred transaction so they see a single WAL snapshot: a checkpoint and
the events after it always belong together.

Event reads check that positions are dense (:mod:`torpor.store.rows`) against
the conversation's recorded head. Outside a snapshot the head is read
*before* the events: the log only grows, so the events read afterwards reach
at least that head, and a shortfall is a hole, never a race with a writer.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from typing import Literal, TypeVar

from torpor.errors import StoreError
from torpor.events import Event, decode_body
from torpor.store.fulltext import ranking_phrases, rarity, term_weights
from torpor.store.hits import (
    Found,
    artifact_bytes,
    beyond_preview,
    deeper,
    expanded_text,
    scored,
    search_hit,
    search_text,
)
from torpor.store.listing import ConversationPage, Cursor, Deletion
from torpor.store.pending import open_calls as pending_open_calls
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    ModelCall,
    OpenCall,
    PendingApproval,
    PendingSummary,
    Resume,
    SearchHit,
)
from torpor.store.rows import (
    EVENT_COLUMNS,
    check_count,
    check_reaches,
    decode_checkpoint,
    decode_model_call,
    page_of,
    to_conversation_info,
    to_events,
    to_pending_approvals,
)
from torpor.store.sqlite import ranking
from torpor.store.sqlite.delete import _tree as tree
from torpor.store.sqlite.delete import read_deletions
from torpor.store.sqlite.schedule_reads import (
    conversation_schedules,
    due_schedules,
    list_schedules,
    next_due,
)
from torpor.store.sqlite.schema import OPEN_WHERE

__all__ = [
    "checkpoints",
    "conversation_schedules",
    "due_schedules",
    "list_schedules",
    "next_due",
    "conversation",
    "conversations",
    "get_artifact",
    "head",
    "keyed",
    "latest_checkpoint",
    "model_calls",
    "open_calls",
    "open_work",
    "page_backward",
    "pending",
    "read_range",
    "read_since",
    "resume",
    "search",
]

T = TypeVar("T")

_KEY = "(SELECT key FROM conversations WHERE external_id = ?)"
_STATE = "SELECT key, head FROM conversations WHERE external_id = ?"
_EVENTS = f"SELECT {EVENT_COLUMNS} FROM events WHERE conversation_id = ?"
_SINCE = f"{_EVENTS} AND position >= ? ORDER BY position"
_RANGE = f"{_EVENTS} AND position BETWEEN ? AND ? ORDER BY position"
_BACKWARD = f"{_EVENTS} AND position < ? ORDER BY position DESC LIMIT ?"
_KEYED = "SELECT first_position, count FROM idempotency_keys WHERE conversation_id = ? AND key = ?"
_LATEST_CHECKPOINT = (
    f"SELECT position, body FROM checkpoints WHERE conversation_id = {_KEY} "
    "ORDER BY id DESC LIMIT 1"
)


def _snapshot(conn: sqlite3.Connection, fn: Callable[[], T]) -> T:
    """Run ``fn`` in one read transaction, always ended: a reader left inside one would
    see that snapshot forever. (Event rows are fetched whole before they are decoded, so a
    CorruptEvent never leaves a statement running, which would make ROLLBACK fail.)"""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.execute("BEGIN")
    try:
        result = fn()
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def subtree(conn: sqlite3.Connection, name: str) -> list[str]:
    """The conversation and its sub-agent conversations that exist, parents first."""

    def read() -> list[str]:
        row = conn.execute("SELECT key FROM conversations WHERE external_id = ?", (name,))
        found = row.fetchone()
        return [] if found is None else [child for child, _ in tree(conn, name, int(found[0]))]

    return _snapshot(conn, read)


def head(conn: sqlite3.Connection, name: str) -> int | None:
    """From the events themselves (one index seek), not the denormalised conversations.head."""
    row = conn.execute(
        f"SELECT max(position) FROM events WHERE conversation_id = {_KEY}", (name,)
    ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _state(conn: sqlite3.Connection, name: str) -> tuple[int, int] | None:
    """(key, recorded head) of a conversation, read before its events (see the module doc)."""
    row = conn.execute(_STATE, (name,)).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


def read_since(conn: sqlite3.Connection, name: str, position: int) -> list[Event]:
    state = _state(conn, name)
    if state is None:
        return []
    key, last = state
    events = to_events(name, conn.execute(_SINCE, (key, position)).fetchall(), position)
    check_reaches(name, events, position, last)
    return events


def read_range(conn: sqlite3.Connection, name: str, start: int, end: int) -> list[Event]:
    state = _state(conn, name)
    if state is None or end < start:
        return []
    key, last = state
    events = to_events(name, conn.execute(_RANGE, (key, start, end)).fetchall(), start)
    check_reaches(name, events, start, min(end, last))
    return events


def keyed(conn: sqlite3.Connection, name: str, key: str) -> list[Event] | None:
    state = _state(conn, name)
    if state is None:
        return None
    row = conn.execute(_KEYED, (state[0], key)).fetchone()
    if row is None:
        return None
    first, count = int(row[0]), int(row[1])
    # The key row and its events were committed together: the events are there.
    return read_range(conn, name, first, first + count - 1)


def page_backward(
    conn: sqlite3.Connection, name: str, before: int | None, limit: int
) -> list[Event]:
    state = _state(conn, name)
    if state is None:
        return []
    key, last = state
    top = last if before is None else min(before - 1, last)
    bound = (1 << 62) if before is None else before
    rows = conn.execute(_BACKWARD, (key, bound, limit)).fetchall()
    # Rows above the recorded head (written behind the store's back) are not holes.
    start = max(top, rows[0][0]) if rows else top
    events = to_events(name, rows, start, -1)
    check_count(name, events, start, limit)
    return events


def latest_checkpoint(conn: sqlite3.Connection, name: str) -> Checkpoint | None:
    row = conn.execute(_LATEST_CHECKPOINT, (name,)).fetchone()
    return None if row is None else decode_checkpoint(name, row[0], row[1])


def checkpoints(conn: sqlite3.Connection, name: str) -> list[Checkpoint]:
    rows = conn.execute(
        f"SELECT position, body FROM checkpoints WHERE conversation_id = {_KEY} ORDER BY id",
        (name,),
    )
    return [decode_checkpoint(name, position, body) for position, body in rows]


def resume(conn: sqlite3.Connection, name: str) -> Resume:
    def read() -> Resume:
        checkpoint = latest_checkpoint(conn, name)
        events = read_since(conn, name, 0 if checkpoint is None else checkpoint.position)
        return Resume(name, head(conn, name), checkpoint, tuple(events))

    return _snapshot(conn, read)


Backlog = Literal["ask", "ignore", "scan"]

_WAITING = "SELECT 1 FROM fts_backlog WHERE rowid BETWEEN ? AND ? LIMIT 1"


def search(
    conn: sqlite3.Connection,
    name: str,
    expression: str,
    query: str,
    k: int,
    backlog: Backlog,
    exclude: frozenset[str] = frozenset(),
) -> list[SearchHit] | None:
    """Ranked hits of one conversation (:mod:`~torpor.store.sqlite.ranking`).

    Events of small batches wait in ``fts_backlog`` before they are indexed
    (see :class:`~torpor.store.sqlite.batch.SearchBacklog`). ``backlog``:
    ``"ask"`` returns None if some of this conversation's do (the store then
    has them indexed and asks again with ``"ignore"``); ``"scan"`` searches them
    in place, in a scratch index, for when the backlog cannot be indexed (the
    database cannot write): their scores come from that small index, so they
    rank less well against the others, but they are found. ``exclude``: tool names
    whose results are left out (:func:`~torpor.store.hits.left_out`); more ranked rows
    are read until ``k`` are kept or there are no more.
    """

    phrases = ranking_phrases(query)  # the terms and adjacent pairs, ranked by rarity

    def read() -> list[SearchHit] | None:
        row = conn.execute("SELECT key, head FROM conversations WHERE external_id = ?", (name,))
        found = row.fetchone()
        if found is None:
            return []
        key = int(found[0])
        low = key << 32
        high = low | 0xFFFFFFFF
        if backlog == "ask" and conn.execute(_WAITING, (low, high)).fetchone() is not None:
            return None
        # Each term's rarity in the conversation (its events: head + 1) weights it.
        events = int(found[1]) + 1
        held = ranking.holding(conn, phrases, key)
        weights = [rarity(events, count) for count in held]
        per_term = term_weights(query, events, held)
        limit: int | None = k
        while limit is not None:
            fetched, found_hits = hits(key, limit, weights, per_term)
            limit = deeper(k, limit, fetched, len(found_hits))
        return scored(found_hits[:k])

    def hits(
        key: int, limit: int, weights: list[float], per_term: list[float]
    ) -> tuple[int, list[Found]]:
        """(ranked rows read, hits kept of them) for the best ``limit`` rows."""
        found = ranking.matches(conn, expression, phrases, weights, key, limit)
        if backlog == "scan":
            low = key << 32
            extra = ranking.scan_backlog(
                conn, expression, phrases, weights, low, low | 0xFFFFFFFF, limit
            )
            found = sorted(found + extra, key=lambda match: (-match[1], -match[2]))[:limit]
        found_hits: list[Found] = []
        for rowid, _, relevance in found:
            position = rowid & 0xFFFFFFFF
            event = conn.execute(
                "SELECT turn, created_at, body FROM events "
                "WHERE conversation_id = ? AND position = ?",
                (key, position),
            ).fetchone()
            if event is None:
                raise StoreError(f"search index names a missing event {name!r}:{position}")
            body = decode_body(event[2], conversation_id=name, position=position)
            text = search_text(body, query, exclude)
            if text is None:
                continue
            artifact = beyond_preview(body, text, query)
            if artifact is not None:
                text = expanded_text(body, get_artifact(conn, artifact))
            found_hits.append(
                search_hit(
                    body,
                    position=position,
                    turn=int(event[0]),
                    created_at=int(event[1]),
                    text=text,
                    query=query,
                    rank=relevance,
                    weights=per_term,
                )
            )
        return len(found), found_hits

    return _snapshot(conn, read)


def get_artifact(conn: sqlite3.Connection, artifact_id: str) -> bytes:
    row = conn.execute("SELECT data FROM artifacts WHERE id = ?", (artifact_id,)).fetchone()
    return artifact_bytes(artifact_id, None if row is None else row[0])


def model_calls(
    conn: sqlite3.Connection, name: str, turn: int | None, limit: int
) -> list[ModelCall]:
    if turn is None:
        rows = conn.execute(
            f"SELECT turn, body FROM model_calls WHERE conversation_id = {_KEY} "
            "ORDER BY turn DESC, call_index DESC, id DESC LIMIT ?",
            (name, limit),
        ).fetchall()
    else:
        rows = conn.execute(
            f"SELECT turn, body FROM model_calls WHERE conversation_id = {_KEY} AND turn = ? "
            "ORDER BY call_index DESC, id DESC LIMIT ?",
            (name, turn, limit),
        ).fetchall()
    rows.reverse()
    return [decode_model_call(name, turn_, body) for turn_, body in rows]


_INFO = (
    "SELECT external_id, head, bytes, checkpoint_position, created_at, updated_at, title, "
    "metadata"
)
# Newest activity first, from conversations_by_activity (a prefix: from the unique index
# of ids, that range's rows sorted; the planner is told which, as it cannot tell how few
# rows a prefix keeps).
_PAGE = (
    f"{_INFO}, key FROM conversations WHERE (updated_at, key) < (?, ?) "
    "ORDER BY updated_at DESC, key DESC LIMIT ?"
)
_PAGE_PREFIX = (
    f"{_INFO}, key FROM conversations INDEXED BY sqlite_autoindex_conversations_1 "
    "WHERE external_id >= ? AND external_id < ? AND (updated_at, key) < (?, ?) "
    "ORDER BY updated_at DESC, key DESC LIMIT ?"
)
_PAGE_OPEN_PREFIX = (
    f"{_INFO}, key FROM conversations INDEXED BY sqlite_autoindex_conversations_1 "
    "WHERE external_id >= ? AND (updated_at, key) < (?, ?) "
    "ORDER BY updated_at DESC, key DESC LIMIT ?"
)
_TOP = (1 << 62, 1 << 62)  # above every cursor: the first page


def list_conversations(
    conn: sqlite3.Connection, span: tuple[str, str | None] | None, cursor: Cursor | None,
    limit: int,
) -> ConversationPage:
    when, key = cursor or _TOP
    if span is None:
        rows = conn.execute(_PAGE, (when, key, limit)).fetchall()
    elif span[1] is None:
        rows = conn.execute(_PAGE_OPEN_PREFIX, (span[0], when, key, limit)).fetchall()
    else:
        rows = conn.execute(_PAGE_PREFIX, (span[0], span[1], when, key, limit)).fetchall()
    return page_of(rows, limit)


# Least recent activity first, from conversations_by_activity (retention, store.idle).
_IDLE = (
    "SELECT external_id, NULL, updated_at, key FROM conversations "
    "WHERE updated_at < ? AND (updated_at, key) > (?, ?) ORDER BY updated_at, key LIMIT ?"
)


def idle(
    conn: sqlite3.Connection, before: int, cursor: Cursor, limit: int, shards: list[int] | None
) -> list[tuple[str, int | None, int, int]]:
    """(id, shard, last activity, key) of the next ``limit`` conversations with no activity
    since ``before`` (epoch ms) after ``cursor``; no shard column here (one node)."""
    return conn.execute(_IDLE, (before, cursor[0], cursor[1], limit)).fetchall()


def conversations(
    conn: sqlite3.Connection, after: str | None, limit: int
) -> list[ConversationInfo]:
    rows = conn.execute(
        f"{_INFO} FROM conversations WHERE external_id > ? ORDER BY external_id LIMIT ?",
        ("" if after is None else after, limit),
    )
    return [to_conversation_info(row) for row in rows]


def conversation(conn: sqlite3.Connection, name: str) -> ConversationInfo | None:
    row = conn.execute(f"{_INFO} FROM conversations WHERE external_id = ?", (name,)).fetchone()
    return None if row is None else to_conversation_info(row)


def pending(conn: sqlite3.Connection, after: str | None, limit: int) -> list[PendingApproval]:
    """Two range scans of the index's primary key, in one snapshot: the next ``limit``
    conversation ids after ``after``, then their calls."""

    def read() -> list[PendingApproval]:
        names = conn.execute(
            "SELECT DISTINCT conversation FROM pending_calls WHERE conversation > ? "
            "ORDER BY conversation LIMIT ?",
            ("" if after is None else after, limit),
        ).fetchall()
        if not names:
            return []
        rows = conn.execute(
            "SELECT conversation, call_id, tool, since, position FROM pending_calls "
            "WHERE conversation BETWEEN ? AND ? ORDER BY conversation, position, ordinal",
            (names[0][0], names[-1][0]),
        )
        return to_pending_approvals(rows)

    return _snapshot(conn, read)



_OPEN_CALLS = (
    "SELECT call_id, tool, since, position FROM pending_calls WHERE conversation = ? "
    "ORDER BY position, ordinal"
)
# The assistant message that made the calls: the newest before their Suspended (a few rows
# back: the tool results of the same step lie between).
_MADE_BY = (
    "SELECT position, body FROM events WHERE conversation_id = " + _KEY + " AND position < ? "
    "AND kind = 'assistant' ORDER BY position DESC LIMIT 1"
)


def open_calls(conn: sqlite3.Connection, name: str) -> list[OpenCall]:
    """The index's rows of one conversation (its primary key's range), then the assistant
    message that made them, in one snapshot."""

    def read() -> list[OpenCall]:
        rows = conn.execute(_OPEN_CALLS, (name,)).fetchall()
        if not rows:
            return []
        found = conn.execute(_MADE_BY, (name, min(row[3] for row in rows))).fetchone()
        made_by = None if found is None else decode_body(
            found[1], conversation_id=name, position=found[0])
        return pending_open_calls(rows, made_by)

    return _snapshot(conn, read)


def pending_summary(conn: sqlite3.Connection) -> PendingSummary:
    """One pass over the index's primary key (the rows of the calls waiting, no more)."""
    row = conn.execute(
        "SELECT count(DISTINCT conversation), count(*), min(since) FROM pending_calls"
    ).fetchone()
    return PendingSummary(row[0], row[1], row[2])


_OPEN = (
    f"SELECT external_id FROM conversations WHERE {OPEN_WHERE} AND external_id > ? "
    "ORDER BY external_id LIMIT ?"
)


def open_work(
    conn: sqlite3.Connection, after: str | None, limit: int, shards: list[int] | None
) -> list[tuple[str, int | None]]:
    """The next ``limit`` open conversations after ``after``, from the partial index over
    them (store.open_work). No shard column here (one node): ``shards`` is the caller's
    to apply, each row's shard None."""
    rows = conn.execute(_OPEN, ("" if after is None else after, limit))
    return [(name, None) for (name,) in rows]


def deletions(conn: sqlite3.Connection, after: int, limit: int) -> list[Deletion]:
    """The deletions audit after ``after`` (see :mod:`.delete`)."""
    return read_deletions(conn, after, limit)
