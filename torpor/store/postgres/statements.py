"""The SQL of the PostgreSQL writer, and the rows-to-arrays step that feeds it.

Every table a batch writes is written by **one** statement: data-modifying CTEs,
one per table, each inserting ``unnest`` of column arrays. Whatever a batch
holds (a thousand appends over a thousand conversations, checkpoints, model
calls), it costs one round trip; empty arrays insert nothing.

The identifier lexemes are only concatenated to a document that has some:
``tsvector || tsvector`` merges and renumbers, and cost about as much as
``to_tsvector`` itself (measured: 8.5 vs 11 ms per 1,000 thirty-word texts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import asyncpg

from torpor.store.open_work import NO_CHANGE
from torpor.store.pending import PendingChanges
from torpor.store.postgres.plan import HeadUpdate, Writes
from torpor.store.postgres.schema import INSERT_PENDING

__all__ = [
    "CREATE",
    "LOCK",
    "LOCK_FENCED",
    "LOCK_SCHEDULES",
    "PENDING_CLEAR",
    "PENDING_REMOVE",
    "WRITE",
    "write",
    "write_pending",
]

# Lock the batch's existing conversations in key order (every writer locks in the same
# order, so two batches cannot deadlock on them) and read their heads and any
# idempotency key the batch asks about. MATERIALIZED: the locking CTE runs in full.
LOCK = """
WITH locked AS MATERIALIZED (
    SELECT key, external_id, head FROM conversations
    WHERE external_id = ANY($1::text[]) ORDER BY key FOR UPDATE
)
SELECT l.key, l.external_id, l.head, i.key, i.first_position, i.count, i.fingerprint,
    CASE WHEN i.key IS NOT NULL AND i.fingerprint IS NULL THEN (
        SELECT e.body FROM events AS e
        WHERE e.conversation_id = l.key AND e.position = i.first_position
    ) END
FROM locked AS l
LEFT JOIN idempotency_keys AS i ON i.conversation_id = l.key AND i.key = ANY($2::text[])
"""

# The same, on a clustered node: also the lease rows of the batch's shards ($3), FOR SHARE
# in shard order, appended as extra rows (only their last two columns set). A takeover
# (an UPDATE of a lease row) therefore waits for this batch to commit, and this batch,
# if a takeover committed first, reads the new epoch and refuses the stale ops.
# Conversations are locked first, leases after; takeovers and renewals lock only leases
# (in shard order), so no cycle can form.
LOCK_FENCED = """
WITH locked AS MATERIALIZED (
    SELECT key, external_id, head FROM conversations
    WHERE external_id = ANY($1::text[]) ORDER BY key FOR UPDATE
),
leases AS MATERIALIZED (
    SELECT shard, epoch FROM shard_leases WHERE shard = ANY($3::int[]) ORDER BY shard FOR SHARE
)
SELECT l.key, l.external_id, l.head, i.key, i.first_position, i.count, i.fingerprint,
    CASE WHEN i.key IS NOT NULL AND i.fingerprint IS NULL THEN (
        SELECT e.body FROM events AS e
        WHERE e.conversation_id = l.key AND e.position = i.first_position
    ) END, NULL::int, NULL::bigint
FROM locked AS l
LEFT JOIN idempotency_keys AS i ON i.conversation_id = l.key AND i.key = ANY($2::text[])
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, shard, epoch FROM leases
"""

# The schedules a batch fires (store.schedules), locked after its conversations (a delete
# locks conversations, then deletes their schedules: the same order), in id order.
LOCK_SCHEDULES = """
SELECT s.id, c.external_id, s.due, s.key FROM schedules AS s
JOIN conversations AS c ON c.key = s.conversation_id
WHERE s.id = ANY($1::text[]) ORDER BY s.id FOR UPDATE OF s
"""
_MOVE_SCHEDULES = """
UPDATE schedules AS s SET due = u.due, fired = s.fired + 1
FROM unnest($1::text[], $2::bigint[]) AS u(id, due) WHERE s.id = u.id
"""
_DELETE_SCHEDULES = "DELETE FROM schedules WHERE id = ANY($1::text[])"

# Create the conversations a batch needs, in name order. A name not returned was
# created (and committed) by another writer meanwhile: the batch locks and re-reads it.
CREATE = """
INSERT INTO conversations (external_id, shard, created_at, updated_at)
SELECT n, s, $3, $3 FROM unnest($1::text[], $2::int[]) AS u(n, s) ORDER BY n
ON CONFLICT (external_id) DO NOTHING
RETURNING key, external_id
"""

# The head update also moves the open-work index's columns (store.open_work) by the batch's
# net change per conversation (-1: unchanged): greatest() and coalesce() of the row's own
# values, so nothing is read for it and nothing else is sent.
WRITE = """
WITH
e AS (
    INSERT INTO events
        (conversation_id, position, turn, kind, tokens, created_at, body, hints, epoch)
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::text[], $5::int[],
                         $6::bigint[], $7::bytea[], $8::bytea[], $9::bigint[])
),
f AS (
    INSERT INTO events_fts (conversation_id, position, chunk, document)
    SELECT c, p, n, CASE WHEN l = '' THEN to_tsvector('simple', t)
        ELSE to_tsvector('simple', t) || array_to_tsvector(string_to_array(l, ' ')) END
    FROM unnest($10::bigint[], $11::bigint[], $12::int[], $13::text[], $14::text[])
        AS u(c, p, n, t, l)
),
a AS (
    INSERT INTO artifacts (id, conversation_id, size, created_at, data)
    SELECT * FROM unnest($15::text[], $16::bigint[], $17::bigint[], $18::bigint[], $19::bytea[])
),
k AS (
    INSERT INTO idempotency_keys
        (conversation_id, key, first_position, count, created_at, fingerprint)
    SELECT * FROM unnest($20::bigint[], $21::text[], $22::bigint[], $23::int[], $24::bigint[],
                         $25::bytea[])
),
cp AS (
    INSERT INTO checkpoints (conversation_id, position, created_at, body)
    SELECT * FROM unnest($26::bigint[], $27::bigint[], $28::bigint[], $29::bytea[])
),
m AS (
    INSERT INTO model_calls (conversation_id, turn, call_index, created_at, body)
    SELECT * FROM unnest($30::bigint[], $31::int[], $32::int[], $33::bigint[], $34::bytea[])
),
h AS (
    UPDATE conversations AS c
    SET head = u.head, bytes = c.bytes + u.added,
        checkpoint_position = coalesce(u.cp, c.checkpoint_position), updated_at = $43,
        user_turn = greatest(c.user_turn, u.ut), settled_turn = greatest(c.settled_turn, u.st),
        suspended = coalesce(nullif(u.su, -1) = 1, c.suspended),
        parked = coalesce(nullif(u.pa, -1) = 1, c.parked),
        title = coalesce(c.title, u.ti)
    FROM unnest($35::bigint[], $36::bigint[], $37::bigint[], $38::bigint[], $39::int[],
                $40::int[], $41::int[], $42::int[], $44::text[])
        AS u(key, head, added, cp, ut, st, su, pa, ti)
    WHERE c.key = u.key
)
SELECT 1
"""

# The pending-approvals index, from a batch's net changes (torpor.store.pending): separate
# statements, in this order, because the sub-statements of one statement all see the
# same snapshot and could not delete a row and insert its replacement.
PENDING_CLEAR = "DELETE FROM pending_calls WHERE conversation = ANY($1::text[])"
PENDING_REMOVE = """
DELETE FROM pending_calls AS p USING unnest($1::text[], $2::text[]) AS u(conversation, call_id)
WHERE p.conversation = u.conversation AND p.call_id = u.call_id
"""


Row = tuple[Any, ...]


def _columns(rows: Sequence[Row], width: int) -> list[list[Any]]:
    """Rows to column arrays (``unnest`` turns them back into rows on the server)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


def _keyed(
    rows: Sequence[Row], at: int, key_of: Callable[[str], int], width: int
) -> list[list[Any]]:
    """Column arrays of ``rows``, the conversation name at index ``at`` replaced by its key."""
    columns = _columns(rows, width)
    columns[at] = [key_of(name) for name in columns[at]]
    return columns


async def write(
    conn: asyncpg.Connection,
    writes: Writes,
    heads: dict[str, HeadUpdate],
    key_of: Callable[[str], int],
    now: int,
) -> None:
    """One statement: every row of ``writes`` and the conversations' new heads."""
    head_rows = [
        (key_of(name), u.head, u.added_bytes, u.checkpoint, *(u.work or NO_CHANGE), u.title)
        for name, u in heads.items()
    ]
    head_columns = _columns(head_rows, 9)
    args: list[Any] = [
        *_keyed(writes.events, 0, key_of, 9),
        *_keyed(writes.fts, 0, key_of, 5),
        *_keyed(writes.artifacts, 1, key_of, 5),
        *_keyed(writes.keys, 0, key_of, 6),
        *_keyed(writes.checkpoints, 0, key_of, 4),
        *_keyed(writes.model_calls, 0, key_of, 5),
        *head_columns[:8],
        now,
        head_columns[8],  # $44: the default titles (store.listing)
    ]
    await conn.execute(WRITE, *args)
    if writes.schedules:  # a batch that fires schedules: rare beside the appends
        moved = [(sid, due) for sid, due, gone in writes.schedules if not gone]
        if moved:
            await conn.execute(_MOVE_SCHEDULES, *_columns(moved, 2))
        gone = [sid for sid, _, deleted in writes.schedules if deleted]
        if gone:
            await conn.execute(_DELETE_SCHEDULES, gone)


async def write_pending(conn: asyncpg.Connection, changes: PendingChanges) -> None:
    """The net changes to the pending-approvals index: at most three statements, only when a
    batch suspended, resolved or aborted something."""
    cleared = changes.cleared()
    if cleared:
        await conn.execute(PENDING_CLEAR, cleared)
    removed = changes.removed()
    if removed:
        await conn.execute(PENDING_REMOVE, *_columns(removed, 2))
    inserted = changes.inserted()
    if inserted:
        await conn.execute(INSERT_PENDING, *_columns(inserted, 6))
