"""The PostgreSQL schema and its forward migrations.

Same logical tables as the SQLite backend (``conversations``, ``events``,
``checkpoints``, ``artifacts``, ``idempotency_keys``, ``model_calls``) plus
``events_fts`` (the search index) and ``schema_version``. Choices:

* ``conversations`` maps the text id to a ``bigint`` surrogate (``key``) and
  holds the **head**. Every write transaction locks the rows of the
  conversations it touches (``SELECT … FOR UPDATE``, in key order), reads the
  head there and moves it in the same transaction, so two writers (two
  processes, or two stores) on one database serialise per conversation and can
  never produce a duplicate or a gap; a stale ``expect_head`` sees the winner's
  head and fails with ConflictError. The head column is the authority for
  positions (``PRIMARY KEY (conversation_id, position)`` stays as a backstop).
  ``external_id`` uses the ``"C"`` collation so listings are ordered by bytes,
  as on SQLite, whatever the database's locale.
* ``events`` holds the msgpack body as ``bytea``; no foreign keys (a check per
  inserted row, and the writer already knows the keys it uses).
* ``events_fts`` holds one ``tsvector`` per event (per 64 KiB chunk of a long
  text), built with the ``simple`` configuration plus identifier lexemes; see
  :mod:`.lexemes`. It is a separate table so reading the log never drags the
  index documents along. A GIN index serves rare terms; the primary key confines
  a search to one conversation.
* ``artifacts.data`` is already zlib-compressed, so its storage is ``EXTERNAL``
  (TOAST out of line, no second compression attempt).

``pending_calls`` (version 2) is the pending-approvals index
(:mod:`torpor.store.pending`), keyed by the conversation's text id (``"C"``
collation, like ``conversations.external_id``) so listing waiting
conversations in id order is one range scan of its primary key; and
``idempotency_keys.fingerprint`` (version 2) identifies what a key was first
used for. ``events.hints`` (version 3) holds the store's hint extractor's bytes
for the body (compaction's topic hints, opaque here), NULL for older rows; adding a
nullable column without a default rewrites nothing. ``memory_episodes``,
``memory_facts``, ``memory_ledger`` and ``memory_turns``
(version 5) hold derived memory (:mod:`torpor.store.memory`), written beside the group
commit (never by an append) and never read by revival.

Version 4 is scale-out (:mod:`torpor.cluster`): ``cluster`` (one row: the shard
count, fixed when the first node creates it), ``nodes`` (membership: each
node's current ``incarnation``, advertised ``address`` and ``lease_until``,
from the database's clock), ``shard_leases`` (one row per shard: ``owner``,
``owner_incarnation``, ``epoch``, ``lease_until``), ``conversations.shard``
(the conversation's shard, written once when a node creates the row; NULL on a
single node) and ``events.epoch`` (the lease epoch that wrote the row; NULL on
a single node). All nullable columns: adding them rewrites nothing.

``event_vectors`` and ``vector_progress`` (version 6) hold the
vectors of hybrid recall (:mod:`torpor.store.vectors`), derived from the log:
``real[]`` (pgvector, where installed, reads it through a cast, so the table does
not depend on the extension) per (conversation, vector space, position), and per
conversation and space the position every event up to which was embedded.

``conversations.user_turn``, ``settled_turn``, ``suspended`` and ``parked``
(version 7) are the open-work index (:mod:`torpor.store.open_work`), moved by
the statement that moves the head (``greatest``/``coalesce`` of the batch's net
change: no read, no extra round trip); ``conversations_open`` and
``conversations_open_by_shard`` are partial indexes over the open rows, by id
and by (shard, id). Updates that leave those four columns as they were stay HOT.

``nodes.departing`` (version 8): the node is leaving the cluster gracefully and
hands its shards off; the others stop counting it as a desired owner at once,
while its row (and so every lease it still holds) stays live until it is done.

``conversations.title`` and ``metadata`` (version 9, titles backfilled from each
conversation's first user message) and ``conversations_by_activity`` on
``(updated_at, key)`` make the row the conversations index
(:mod:`torpor.store.listing`); the head update sets the default title in the same
statement. That index changes with every append, so those updates are no longer HOT.
``deletions`` (version 9) is the audit of removals (:mod:`.delete`).

Version 10 rebuilds the documents of events whose text the normalised form
(:mod:`torpor.store.normalise`: diacritics folded, digit grouping removed) changes, the
form appends index from then on (:mod:`.reindex`).

``schema_version`` has one row per applied migration. ``MIGRATIONS[i]`` takes
the schema from version ``i`` to ``i + 1``; each runs in its own transaction
together with its version row, under a transaction-scoped advisory lock, so two
processes opening a fresh database at once migrate it exactly once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from torpor.errors import StoreError
from torpor.events import decode_body
from torpor.store.listing import first_title
from torpor.store.open_work import BACKFILL_SELECT, Backfill
from torpor.store.pending import PendingChanges, call_names, named, unnamed
from torpor.store.postgres.reindex import reindex

__all__ = ["INSERT_PENDING", "MIGRATIONS", "OPEN_WHERE", "SCHEMA_VERSION", "migrate"]

_MIGRATION_LOCK = 0x746F72706F72  # "torpor": the advisory lock id serialising migrations

Step = str | Callable[[asyncpg.Connection], Awaitable[None]]

_V1: Sequence[Step] = (
    """
    CREATE TABLE conversations (
        key bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        external_id text COLLATE "C" NOT NULL UNIQUE,
        head bigint NOT NULL DEFAULT -1,
        bytes bigint NOT NULL DEFAULT 0,
        checkpoint_position bigint,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL
    )
    """,
    """
    CREATE TABLE events (
        conversation_id bigint NOT NULL,
        position bigint NOT NULL,
        turn integer NOT NULL,
        kind text NOT NULL,
        tokens integer NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL,
        PRIMARY KEY (conversation_id, position)
    )
    """,
    """
    CREATE TABLE events_fts (
        conversation_id bigint NOT NULL,
        position bigint NOT NULL,
        chunk integer NOT NULL,
        document tsvector NOT NULL,
        PRIMARY KEY (conversation_id, position, chunk)
    )
    """,
    "CREATE INDEX events_fts_document ON events_fts USING gin (document)",
    """
    CREATE TABLE checkpoints (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        conversation_id bigint NOT NULL,
        position bigint NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL
    )
    """,
    "CREATE INDEX checkpoints_by_conversation ON checkpoints (conversation_id, id)",
    """
    CREATE TABLE artifacts (
        id text PRIMARY KEY,
        conversation_id bigint NOT NULL,
        size bigint NOT NULL,
        created_at bigint NOT NULL,
        data bytea NOT NULL
    )
    """,
    "ALTER TABLE artifacts ALTER COLUMN data SET STORAGE EXTERNAL",
    """
    CREATE TABLE idempotency_keys (
        conversation_id bigint NOT NULL,
        key text NOT NULL,
        first_position bigint NOT NULL,
        count integer NOT NULL,
        created_at bigint NOT NULL,
        PRIMARY KEY (conversation_id, key)
    )
    """,
    """
    CREATE TABLE model_calls (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        conversation_id bigint NOT NULL,
        turn integer NOT NULL,
        call_index integer NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL
    )
    """,
    "CREATE INDEX model_calls_by_turn ON model_calls (conversation_id, turn, call_index)",
)

INSERT_PENDING = """
INSERT INTO pending_calls (conversation, call_id, tool, since, position, ordinal)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::int[])
ON CONFLICT (conversation, call_id) DO UPDATE SET tool = excluded.tool,
    since = excluded.since, position = excluded.position, ordinal = excluded.ordinal
"""


async def _backfill_pending(conn: asyncpg.Connection) -> None:
    """The index as the log implies it; tool names of old suspensions from their calls."""
    changes = PendingChanges()
    async for name, position, created_at, body in conn.cursor(
        "SELECT c.external_id, e.position, e.created_at, e.body FROM events AS e "
        "JOIN conversations AS c ON c.key = e.conversation_id "
        "WHERE e.kind IN ('suspended', 'resolved', 'aborted') "
        "ORDER BY e.conversation_id, e.position",
        prefetch=1000,
    ):
        decoded = decode_body(body, conversation_id=name, position=position)
        changes.apply(name, position, created_at, decoded)
    rows = changes.inserted()
    names: dict[tuple[str, str], str] = {}
    for name, (latest, calls) in unnamed(rows).items():
        async for position, body in conn.cursor(
            "SELECT e.position, e.body FROM events AS e JOIN conversations AS c "
            "ON c.key = e.conversation_id WHERE c.external_id = $1 AND e.kind = 'assistant' "
            "AND e.position < $2 ORDER BY e.position DESC",
            name,
            latest,
        ):
            decoded = decode_body(body, conversation_id=name, position=position)
            for call_id, tool in call_names(decoded):
                if call_id in calls:
                    names[(name, call_id)] = tool
                    calls.discard(call_id)
            if not calls:
                break
    rows = named(rows, names)
    if rows:
        await conn.execute(INSERT_PENDING, *(list(column) for column in zip(*rows, strict=True)))


_V2: Sequence[Step] = (
    "ALTER TABLE idempotency_keys ADD COLUMN fingerprint bytea",
    """
    CREATE TABLE pending_calls (
        conversation text COLLATE "C" NOT NULL,
        call_id text NOT NULL,
        tool text NOT NULL,
        since bigint NOT NULL,
        position bigint NOT NULL,
        ordinal integer NOT NULL,
        PRIMARY KEY (conversation, call_id)
    )
    """,
    _backfill_pending,
)

_V3: Sequence[Step] = ("ALTER TABLE events ADD COLUMN hints bytea",)

# IF NOT EXISTS throughout: nothing here depends on what an earlier run of it left.
_V4: Sequence[Step] = (
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS shard integer",
    "ALTER TABLE events ADD COLUMN IF NOT EXISTS epoch bigint",
    """
    CREATE TABLE IF NOT EXISTS cluster (
        singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
        shards integer NOT NULL CHECK (shards > 0),
        created_at timestamptz NOT NULL DEFAULT now()
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS nodes (
        node_id text COLLATE "C" PRIMARY KEY,
        incarnation bigint NOT NULL,
        address text NOT NULL,
        lease_until timestamptz NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS shard_leases (
        shard integer PRIMARY KEY,
        owner text COLLATE "C",
        owner_incarnation bigint,
        epoch bigint NOT NULL DEFAULT 0,
        lease_until timestamptz
    )
    """,
)

# Derived memory (torpor.store.memory), never the log: episodic and semantic items written
# at folds, the consolidation ledger, and the turns a hot-path reconciler said NONE for.
# Version 5. IF NOT EXISTS throughout, like version 4.
_MEMORY: Sequence[Step] = (
    """
    CREATE TABLE IF NOT EXISTS memory_episodes (
        conversation_id bigint NOT NULL,
        position bigint NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL,
        PRIMARY KEY (conversation_id, position)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS memory_facts (
        conversation_id bigint NOT NULL,
        position bigint NOT NULL,
        ordinal integer NOT NULL,
        key text NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL,
        PRIMARY KEY (conversation_id, position, ordinal)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS memory_ledger (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        conversation_id bigint NOT NULL,
        key text NOT NULL,
        created_at bigint NOT NULL,
        body bytea NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS memory_ledger_by_key ON memory_ledger (conversation_id, key, id)",
    """
    CREATE TABLE IF NOT EXISTS memory_turns (
        conversation_id bigint NOT NULL,
        turn integer NOT NULL,
        decision text NOT NULL,
        created_at bigint NOT NULL,
        PRIMARY KEY (conversation_id, turn)
    )
    """,
)

_VECTORS: Sequence[Step] = (
    # Hybrid recall's vectors (torpor.store.vectors): derived, never read by the log.
    """
    CREATE TABLE IF NOT EXISTS event_vectors (
        conversation_id bigint NOT NULL,
        space text NOT NULL,
        position bigint NOT NULL,
        vector real[] NOT NULL,
        PRIMARY KEY (conversation_id, space, position)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS vector_progress (
        conversation_id bigint NOT NULL,
        space text NOT NULL,
        position bigint NOT NULL,
        PRIMARY KEY (conversation_id, space)
    )
    """,
)

OPEN_WHERE = "user_turn > settled_turn AND NOT suspended AND NOT parked"


async def _backfill_open_work(conn: asyncpg.Connection) -> None:
    """The open-work columns as the log sets them (store.open_work)."""
    backfill = Backfill()
    async for row in conn.cursor(BACKFILL_SELECT, prefetch=1000):
        backfill.add(*row)
    rows = backfill.rows()
    if rows:
        await conn.execute(
            "UPDATE conversations AS c SET user_turn = u.ut, settled_turn = u.st, "
            "suspended = u.su = 1, parked = u.pa = 1 FROM unnest($1::int[], $2::int[], "
            "$3::int[], $4::int[], $5::text[]) AS u(ut, st, su, pa, name) "
            "WHERE c.external_id = u.name",
            *(list(column) for column in zip(*rows, strict=True)),
        )


# The open-work index (store.open_work): four columns of the conversation row (constant
# defaults: adding them rewrites nothing), backfilled from the log, and two partial indexes
# over the open rows: by id (pages of every open row in id order; without it the planner,
# which cannot tell how few rows "user_turn > settled_turn" keeps, walks every conversation
# by the unique index of ids, measured), and by (shard, id) for a node's shards. IF NOT
# EXISTS throughout, like version 4.
_OPEN_WORK: Sequence[Step] = (
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS user_turn integer NOT NULL DEFAULT -1",
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS settled_turn integer NOT NULL "
    "DEFAULT -1",
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS suspended boolean NOT NULL "
    "DEFAULT false",
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS parked boolean NOT NULL DEFAULT false",
    _backfill_open_work,
    f"CREATE INDEX IF NOT EXISTS conversations_open ON conversations (external_id) "
    f"WHERE {OPEN_WHERE}",
    "CREATE INDEX IF NOT EXISTS conversations_open_by_shard ON conversations "
    f"(shard, external_id) WHERE {OPEN_WHERE}",
)

_DEPARTING: Sequence[Step] = (
    "ALTER TABLE nodes ADD COLUMN IF NOT EXISTS departing boolean NOT NULL DEFAULT false",
)

async def _backfill_titles(conn: asyncpg.Connection) -> None:
    """Each conversation's first user message as its default title (one probe of its own
    events by primary key, not a scan of the log by kind)."""
    rows = []
    async for key, body in conn.cursor(
        "SELECT c.key, (SELECT e.body FROM events AS e WHERE e.conversation_id = c.key "
        "AND e.kind = 'user' ORDER BY e.position LIMIT 1) FROM conversations AS c "
        "WHERE c.title IS NULL",
        prefetch=1000,
    ):
        if body is not None:
            title = first_title([decode_body(body, conversation_id=str(key), position=0)])
            rows.append((key, title))
    if rows:
        await conn.execute(
            "UPDATE conversations AS c SET title = u.t FROM unnest($1::bigint[], $2::text[]) "
            "AS u(k, t) WHERE c.key = u.k",
            [k for k, _ in rows], [t for _, t in rows],
        )


# The conversations index (store.listing): title and metadata on the conversation's row,
# an index by last activity, and the audit of deletions (ids and counts, never content).
_LISTING: Sequence[Step] = (
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS title text",
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS metadata text",
    _backfill_titles,
    "CREATE INDEX IF NOT EXISTS conversations_by_activity ON conversations (updated_at, key)",
    """
    CREATE TABLE IF NOT EXISTS deletions (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        at bigint NOT NULL,
        by text NOT NULL,
        conversations text NOT NULL,
        rows text NOT NULL
    )
    """,
)

# The full-text index in the normalised form (store.normalise: diacritics folded, digit
# grouping removed): the documents that form changes, rebuilt (store.postgres.reindex).
_NORMALISED: Sequence[Step] = (reindex,)

# Schedules (torpor.store.schedules): one row each, keyed by the conversation's key; an
# index on the due time of the pending ones (what the runtime's one timer reads), one per
# conversation, and a conversation's idempotency keys. Self-contained: no backfill.
_SCHEDULES: Sequence[Step] = (
    """
    CREATE TABLE IF NOT EXISTS schedules (
        id text PRIMARY KEY,
        conversation_id bigint NOT NULL,
        due bigint,
        every bigint,
        text text NOT NULL,
        key text,
        fingerprint bytea,
        created_at bigint NOT NULL,
        fired integer NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX IF NOT EXISTS schedules_due ON schedules (due, id) WHERE due IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS schedules_by_conversation ON schedules (conversation_id, due)",
    "CREATE UNIQUE INDEX IF NOT EXISTS schedules_key ON schedules (conversation_id, key) "
    "WHERE key IS NOT NULL",
)

MIGRATIONS: tuple[Sequence[Step], ...] = (
    _V1, _V2, _V3, _V4, _MEMORY, _VECTORS, _OPEN_WORK, _DEPARTING, _LISTING, _NORMALISED,
    _SCHEDULES
)
SCHEMA_VERSION = len(MIGRATIONS)

_VERSION_TABLE = """
    CREATE TABLE IF NOT EXISTS schema_version (
        version integer PRIMARY KEY,
        applied_at timestamptz NOT NULL DEFAULT now()
    )
"""


async def migrate(conn: asyncpg.Connection) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`; refuse a database from the future."""
    while True:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(_VERSION_TABLE)
            version = int(
                await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version")
            )
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"database schema version {version} is newer than this torpor "
                    f"understands ({SCHEMA_VERSION}); upgrade torpor"
                )
            if version == SCHEMA_VERSION:
                return version
            for step in MIGRATIONS[version]:
                if isinstance(step, str):
                    await conn.execute(step)
                else:
                    await step(conn)
            await conn.execute("INSERT INTO schema_version (version) VALUES ($1)", version + 1)
