"""The read side on PostgreSQL: every public read is one SQL statement, one round trip.

A single statement sees a single snapshot, so ``resume`` (the latest checkpoint,
the head and every event since the checkpoint) needs no explicit transaction:
it is one ``UNION ALL`` whose first row carries the checkpoint and the head.
The other event reads use the same shape (a first row with the head, then the
events), because the head is what their density check needs.
Rows decode exactly as on SQLite (:mod:`torpor.store.rows`): a body that
does not decode, or a position that is missing, raises CorruptEvent naming its
conversation and position.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from torpor.events import Event, decode_body
from torpor.store.fulltext import LENGTH_BYTES, ranking_terms, term_groups, term_weights
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
from torpor.store.postgres.delete import _tree as tree
from torpor.store.postgres.lexemes import search_terms
from torpor.store.postgres.schedule_reads import (
    conversation_schedules,
    due_schedules,
    list_schedules,
    next_due,
)
from torpor.store.postgres.schema import OPEN_WHERE
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
    check_count,
    check_reaches,
    decode_checkpoint,
    decode_model_call,
    page_of,
    to_conversation_info,
    to_events,
    to_pending_approvals,
)

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


_TREE_KEY = "SELECT key FROM conversations WHERE external_id = $1"


class Reader(Protocol):
    """What reads need: an asyncpg pool or connection."""

    async def fetch(self, query: str, *args: Any) -> list[Any]: ...

    async def fetchrow(self, query: str, *args: Any) -> Any: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...


_KEY = "(SELECT key FROM conversations WHERE external_id = $1)"

# Row 0: (NULL, head, NULL, NULL, NULL, NULL, 0), if the conversation exists; then the events.
_WITH_HEAD = """
WITH conv AS (SELECT key, head FROM conversations WHERE external_id = $1)
SELECT NULL::bigint AS pos, head, NULL::bigint, NULL::bigint, NULL::bytea, NULL::bytea,
    0 AS r FROM conv
UNION ALL
(SELECT e.position, e.turn::bigint, e.tokens::bigint, e.created_at, e.body, e.hints, 1
 FROM events AS e, conv WHERE e.conversation_id = conv.key AND {where})
ORDER BY r, pos {order}
"""
_SINCE = _WITH_HEAD.format(where="e.position >= $2", order="")
_RANGE = _WITH_HEAD.format(where="e.position BETWEEN $2 AND $3", order="")
_BACKWARD = _WITH_HEAD.format(
    where="e.position < $2 ORDER BY e.position DESC LIMIT $3", order="DESC"
)
# Row 0: (NULL, first position, count, …) if the key was used; then the events it wrote.
_KEYED = """
WITH conv AS (SELECT key FROM conversations WHERE external_id = $1),
k AS (
    SELECT i.first_position AS f, i.count AS n FROM idempotency_keys AS i, conv
    WHERE i.conversation_id = conv.key AND i.key = $2
)
SELECT NULL::bigint AS pos, k.f, k.n::bigint, NULL::bigint, NULL::bytea, NULL::bytea, 0 AS r
FROM k
UNION ALL
(SELECT e.position, e.turn::bigint, e.tokens::bigint, e.created_at, e.body, e.hints, 1
 FROM events AS e, conv, k
 WHERE e.conversation_id = conv.key AND e.position >= k.f AND e.position < k.f + k.n)
ORDER BY r, pos
"""
_CHECKPOINTS = "SELECT position, body FROM checkpoints WHERE conversation_id = " + _KEY
_LATEST = f"{_CHECKPOINTS} ORDER BY id DESC LIMIT 1"

# Row 0: (NULL, head, checkpoint position, NULL, checkpoint body, NULL); then the events.
_RESUME = """
WITH conv AS (SELECT key, head FROM conversations WHERE external_id = $1),
cp AS (
    SELECT c.position, c.body FROM checkpoints AS c, conv
    WHERE c.conversation_id = conv.key ORDER BY c.id DESC LIMIT 1
)
SELECT NULL::bigint AS pos, conv.head, cp.position AS cp, NULL::bigint AS ts, cp.body,
    NULL::bytea AS hints, 0 AS r
FROM conv LEFT JOIN cp ON true
UNION ALL
SELECT e.position, e.turn::bigint, e.tokens::bigint, e.created_at, e.body, e.hints, 1
FROM events AS e, conv
WHERE e.conversation_id = conv.key AND e.position >= coalesce((SELECT position FROM cp), 0)
ORDER BY r, pos
"""

# Terms: per query term, its phrase or its identifier alternative (see .lexemes), and
# its group (terms equal case folded share one); after the $6 query terms, their adjacent
# pairs (torpor.store.fulltext.ranking_terms), which weigh but add no ts_rank. The order
# is torpor.store.fulltext's: the distinct terms an event holds (over all its chunks),
# each counted by its rarity (ln(1 + events / events holding it): fulltext.rarity, the
# events being head + 1), then its best chunk's ts_rank summed over the terms, divided by
# the length factor of its stored body. Every row also carries the counts per group and
# the head, from which Python weighs the same terms (fulltext.term_weights).
_SEARCH = f"""
WITH conv AS (SELECT key, head FROM conversations WHERE external_id = $1),
terms AS (
    SELECT q, g FROM (
        SELECT CASE WHEN i = '' THEN phraseto_tsquery('simple', t)
                    ELSE phraseto_tsquery('simple', t) || i::tsquery END AS q, g
        FROM unnest($2::text[], $3::text[], $5::int[]) AS u(t, i, g)
    ) AS s
    WHERE numnode(q) > 0
),
query AS (SELECT string_agg('(' || q::text || ')', ' | ')::tsquery AS q FROM terms),
held AS (
    SELECT f.position, f.chunk, t.g, ts_rank(f.document, t.q) AS r
    FROM events_fts AS f JOIN terms AS t ON f.document @@ t.q
    WHERE f.conversation_id = (SELECT key FROM conv) AND f.document @@ (SELECT q FROM query)
),
counts AS (SELECT g, count(DISTINCT position) AS n FROM held GROUP BY g),
weights AS (
    SELECT g, ln(1.0 + greatest((SELECT head FROM conv) + 1, 1)::float8 / greatest(n, 1)) AS w
    FROM counts
),
chunks AS (
    SELECT position, coalesce(sum(r) FILTER (WHERE g < $6), 0.0) AS score
    FROM held GROUP BY position, chunk
),
best AS (
    SELECT c.position, max(c.score) AS score,
        (SELECT sum(w.w) FROM weights AS w
         WHERE w.g IN (SELECT h.g FROM held AS h WHERE h.position = c.position)) AS held
    FROM chunks AS c GROUP BY c.position
),
ranked AS (
    SELECT b.position, b.held,
        b.score / (1.0 + ln(1.0 + octet_length(e.body) / {LENGTH_BYTES})) AS relevance,
        e.turn, e.created_at, e.body
    FROM best AS b
    JOIN events AS e ON e.conversation_id = (SELECT key FROM conv) AND e.position = b.position
    ORDER BY b.held DESC, relevance DESC, b.position DESC LIMIT $4
)
SELECT position, relevance, turn, created_at, body,
    (SELECT array_agg(g) FROM counts) AS groups, (SELECT array_agg(n) FROM counts) AS counts,
    (SELECT head FROM conv) AS head
FROM ranked
ORDER BY held DESC, relevance DESC, position DESC
"""

_INFO = (
    "SELECT external_id, head, bytes, checkpoint_position, created_at, updated_at, title, "
    "metadata"
)
# Newest activity first from conversations_by_activity; a prefix is a range of the unique
# index of ids ("C" collation: byte order), that range's rows then sorted.
_PAGE = (
    f"{_INFO}, key FROM conversations WHERE (updated_at, key) < ($1, $2) "
    "ORDER BY updated_at DESC, key DESC LIMIT $3"
)
_PAGE_PREFIX = (
    f"{_INFO}, key FROM conversations WHERE external_id >= $4 "
    "AND ($5::text IS NULL OR external_id < $5) AND (updated_at, key) < ($1, $2) "
    "ORDER BY updated_at DESC, key DESC LIMIT $3"
)
_TOP = (1 << 62, 1 << 62)


async def list_conversations(
    db: Reader, span: tuple[str, str | None] | None, cursor: Cursor | None, limit: int
) -> ConversationPage:
    when, key = cursor or _TOP
    if span is None:
        rows = await db.fetch(_PAGE, when, key, limit)
    else:
        rows = await db.fetch(_PAGE_PREFIX, when, key, limit, span[0], span[1])
    return page_of(rows, limit)


# Least recent activity first, from conversations_by_activity (retention, store.idle).
_IDLE = (
    "SELECT external_id, shard, updated_at, key FROM conversations "
    "WHERE updated_at < $1 AND (updated_at, key) > ($2, $3) {shards}"
    "ORDER BY updated_at, key LIMIT $4"
)
_IDLE_ALL = _IDLE.format(shards="")
_IDLE_IN = _IDLE.format(shards="AND (shard = ANY($5::int[]) OR shard IS NULL) ")


async def idle(
    db: Reader, before: int, cursor: Cursor, limit: int, shards: list[int] | None
) -> list[tuple[str, int | None, int, int]]:
    """(id, shard, last activity, key) of the next ``limit`` conversations with no activity
    since ``before`` (epoch ms) after ``cursor``, of ``shards`` (or shardless) if given."""
    if shards is None:
        rows = await db.fetch(_IDLE_ALL, before, cursor[0], cursor[1], limit)
    else:
        rows = await db.fetch(_IDLE_IN, before, cursor[0], cursor[1], limit, shards)
    return [(r[0], r[1], int(r[2]), int(r[3])) for r in rows]


async def deletions(db: Reader, after: int, limit: int) -> list[Deletion]:
    rows = await db.fetch(
        "SELECT id, conversations, rows, at, by FROM deletions WHERE id > $1 ORDER BY id "
        "LIMIT $2", after, limit,
    )
    return [
        Deletion(int(r[0]), tuple(msgspec.json.decode(r[1])), msgspec.json.decode(r[2]),
                 int(r[3]), str(r[4]))
        for r in rows
    ]


async def subtree(db: Reader, name: str) -> list[str]:
    """The conversation and its sub-agent conversations that exist, parents first."""
    key = await db.fetchval(_TREE_KEY, name)
    if key is None:
        return []
    return [child for child, _ in await tree(db, name, int(key))]


async def head(db: Reader, name: str) -> int | None:
    value = await db.fetchval("SELECT head FROM conversations WHERE external_id = $1", name)
    return None if value is None or value < 0 else int(value)


def _split(rows: list[Any]) -> tuple[int, list[Any]]:
    """(recorded head, event rows) of a ``_WITH_HEAD`` result; head -1 if no conversation."""
    if not rows:
        return -1, []
    return int(rows[0][1]), [row[:6] for row in rows[1:]]


async def read_since(db: Reader, name: str, position: int) -> list[Event]:
    last, rows = _split(await db.fetch(_SINCE, name, position))
    events = to_events(name, rows, position)
    check_reaches(name, events, position, last)
    return events


async def read_range(db: Reader, name: str, start: int, end: int) -> list[Event]:
    if end < start:
        return []
    last, rows = _split(await db.fetch(_RANGE, name, start, end))
    events = to_events(name, rows, start)
    check_reaches(name, events, start, min(end, last))
    return events


async def keyed(db: Reader, name: str, key: str) -> list[Event] | None:
    rows = await db.fetch(_KEYED, name, key)
    if not rows:
        return None
    first, count = int(rows[0][1]), int(rows[0][2])
    events = to_events(name, [row[:6] for row in rows[1:]], first)
    check_reaches(name, events, first, first + count - 1)
    return events


async def page_backward(db: Reader, name: str, before: int | None, limit: int) -> list[Event]:
    bound = (1 << 62) if before is None else before
    last, rows = _split(await db.fetch(_BACKWARD, name, bound, limit))
    top = last if before is None else min(before - 1, last)
    start = max(top, rows[0][0]) if rows else top  # rows above the head are not holes
    events = to_events(name, rows, start, -1)
    check_count(name, events, start, limit)
    return events


async def latest_checkpoint(db: Reader, name: str) -> Checkpoint | None:
    row = await db.fetchrow(_LATEST, name)
    return None if row is None else decode_checkpoint(name, row[0], row[1])


async def checkpoints(db: Reader, name: str) -> list[Checkpoint]:
    rows = await db.fetch(f"{_CHECKPOINTS} ORDER BY id", name)
    return [decode_checkpoint(name, position, body) for position, body in rows]


async def resume(db: Reader, name: str) -> Resume:
    rows = await db.fetch(_RESUME, name)
    if not rows:
        return Resume(name, None, None, ())
    _, last, cp_position, _, cp_body, _, _ = rows[0]
    checkpoint = None if cp_body is None else decode_checkpoint(name, cp_position, cp_body)
    start = 0 if checkpoint is None else checkpoint.position
    events = to_events(name, (row[:6] for row in rows[1:]), start)
    check_reaches(name, events, start, last)
    return Resume(name, None if last < 0 else last, checkpoint, tuple(events))


async def search(
    db: Reader, name: str, query: str, k: int, exclude: frozenset[str] = frozenset()
) -> list[SearchHit]:
    """Ranked hits (see _SEARCH); results of the tools named in ``exclude`` left out (more
    ranked rows read until ``k`` are kept or there are no more)."""
    terms, identifiers = search_terms(query)
    if not terms:
        return []
    single = len(terms)
    pairs = ranking_terms(query)[single:]  # adjacent pairs: phrases, no identifier fallback
    terms, identifiers = terms + pairs, identifiers + [""] * len(pairs)
    groups = term_groups(terms)
    limit: int | None = k
    while limit is not None:
        rows = await db.fetch(_SEARCH, name, terms, identifiers, limit, groups, single)
        found = await _hits(db, name, query, rows, exclude, _weights(query, groups, rows))
        limit = deeper(k, limit, len(rows), len(found))
    return scored(found[:k])


def _weights(query: str, groups: list[int], rows: list[Any]) -> list[float] | None:
    """Each query term's rarity, from the counts _SEARCH returns with every row."""
    if not rows:
        return None
    _, _, _, _, _, held_groups, counts, head = rows[0]
    count_of = dict(zip(held_groups or (), counts or (), strict=True))
    holding = [int(count_of.get(group, 0)) for group in sorted(set(groups))]
    return term_weights(query, int(head) + 1, holding)


async def _hits(
    db: Reader,
    name: str,
    query: str,
    rows: list[Any],
    exclude: frozenset[str],
    weights: list[float] | None,
) -> list[Found]:
    found: list[Found] = []
    for position, score, turn, created_at, data, *_ in rows:
        body = decode_body(data, conversation_id=name, position=position)
        text = search_text(body, query, exclude)
        if text is None:
            continue
        artifact = beyond_preview(body, text, query)
        if artifact is not None:
            text = expanded_text(body, await get_artifact(db, artifact))
        found.append(
            search_hit(
                body,
                position=position,
                turn=turn,
                created_at=created_at,
                text=text,
                query=query,
                rank=float(score),
                weights=weights,
            )
        )
    return found


async def get_artifact(db: Reader, artifact_id: str) -> bytes:
    data = await db.fetchval("SELECT data FROM artifacts WHERE id = $1", artifact_id)
    return artifact_bytes(artifact_id, data)


async def model_calls(db: Reader, name: str, turn: int | None, limit: int) -> list[ModelCall]:
    base = f"SELECT turn, body FROM model_calls WHERE conversation_id = {_KEY}"
    if turn is None:
        rows = await db.fetch(f"{base} ORDER BY turn DESC, call_index DESC, id DESC LIMIT $2",
                              name, limit)  # fmt: skip
    else:
        rows = await db.fetch(
            f"{base} AND turn = $2 ORDER BY call_index DESC, id DESC LIMIT $3", name, turn, limit
        )
    return [decode_model_call(name, t, body) for t, body in reversed(rows)]


async def conversations(db: Reader, after: str | None, limit: int) -> list[ConversationInfo]:
    rows = await db.fetch(
        f"{_INFO} FROM conversations WHERE external_id > $1 ORDER BY external_id LIMIT $2",
        "" if after is None else after,
        limit,
    )
    return [to_conversation_info(row) for row in rows]


async def conversation(db: Reader, name: str) -> ConversationInfo | None:
    row = await db.fetchrow(f"{_INFO} FROM conversations WHERE external_id = $1", name)
    return None if row is None else to_conversation_info(row)


_PENDING = """
WITH names AS (
    SELECT DISTINCT conversation FROM pending_calls WHERE conversation > $1
    ORDER BY conversation LIMIT $2
)
SELECT p.conversation, p.call_id, p.tool, p.since, p.position
FROM pending_calls AS p JOIN names AS n ON n.conversation = p.conversation
ORDER BY p.conversation, p.position, p.ordinal
"""


async def pending(db: Reader, after: str | None, limit: int) -> list[PendingApproval]:
    """The next ``limit`` waiting conversations after ``after``, from the index's primary key."""
    rows = await db.fetch(_PENDING, "" if after is None else after, limit)
    return to_pending_approvals(tuple(row) for row in rows)


# The conversation's index rows, then (r = 1) the assistant message that made the calls:
# the newest before their oldest Suspended, a few rows back by the events' primary key.
_OPEN_CALLS = """
WITH p AS (
    SELECT call_id, tool, since, position, ordinal FROM pending_calls WHERE conversation = $1
)
SELECT call_id, tool, since, position, ordinal, NULL::bytea AS body, 0 AS r FROM p
UNION ALL
(SELECT NULL, NULL, NULL, e.position, NULL, e.body, 1
 FROM events AS e JOIN conversations AS c ON c.key = e.conversation_id
 WHERE c.external_id = $1 AND e.kind = 'assistant'
   AND e.position < (SELECT min(position) FROM p)
 ORDER BY e.position DESC LIMIT 1)
"""


async def open_calls(db: Reader, name: str) -> list[OpenCall]:
    """One statement (one snapshot): the rows of one conversation and the message behind."""
    rows = await db.fetch(_OPEN_CALLS, name)
    calls = sorted((row for row in rows if row[6] == 0), key=lambda row: (row[3], row[4]))
    made = [row for row in rows if row[6] == 1]
    made_by = decode_body(made[0][5], conversation_id=name, position=made[0][3]) \
        if made else None
    return pending_open_calls([(r[0], r[1], r[2], r[3]) for r in calls], made_by)


async def pending_summary(db: Reader) -> PendingSummary:
    """One pass over the index (the rows of the calls waiting, no more)."""
    row = await db.fetchrow(
        "SELECT count(DISTINCT conversation), count(*), min(since) FROM pending_calls"
    )
    assert row is not None
    return PendingSummary(row[0], row[1], row[2])


# The partial indexes over open rows (schema version 7, store.open_work): by id, or by
# (shard, id) for a node's shards, whichever the planner finds cheaper; either reads open
# rows only. A row written on a single node has no shard: it comes back too, for the
# caller to place.
_OPEN = (
    f"SELECT external_id, shard FROM conversations WHERE {OPEN_WHERE} AND external_id > $1 "
    "{shards}ORDER BY external_id LIMIT $2"
)
_OPEN_ALL = _OPEN.format(shards="")
_OPEN_IN = _OPEN.format(shards="AND (shard = ANY($3::int[]) OR shard IS NULL) ")


async def open_work(
    db: Reader, after: str | None, limit: int, shards: list[int] | None
) -> list[tuple[str, int | None]]:
    """The next ``limit`` open conversations after ``after`` (of ``shards``, or shardless)."""
    first = "" if after is None else after
    if shards is None:
        rows = await db.fetch(_OPEN_ALL, first, limit)
    else:
        rows = await db.fetch(_OPEN_IN, first, limit, shards)
    return [(row[0], row[1]) for row in rows]
