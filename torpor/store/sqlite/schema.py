"""The SQLite schema, its forward migrations, and connection settings.

Physical choices (measured on the 2-core development machine with
interleaved appends from 1,000 conversations, 30-word bodies):

* ``events`` is a rowid table with ``PRIMARY KEY (conversation_id, position)``
  (an index beside the row). Rows arrive in rowid order, so a batch that
  interleaves a thousand conversations writes to the end of the table instead
  of scattering across a clustered ``WITHOUT ROWID`` B-tree: with full-text
  indexing ~50k vs ~25k rows/s (without it ~220k vs ~55k), at the price of
  ~50 µs more to read 50 rows, far under the 1 ms read target.
* ``conversations`` maps the text id to an integer surrogate (``key``) so rows
  and indexes stay small; ``events.conversation_id`` holds that integer.
* ``events_fts`` is a contentless FTS5 index: no second copy of the text
  (storing content cut indexing speed by ~3x). Its rowid is
  ``key << 32 | position``, so a search is confined to one conversation by a
  rowid range instead of a join over every conversation's matches. Hence
  conversation keys stay below 2**31 and positions below 2**32.
* ``bm25`` length normalisation is off (``columnsize=0`` saves a table write
  per event); term rarity still ranks.
* ``conversations.head``/``bytes`` are denormalised for listings; positions are
  always derived from the events themselves (see :mod:`.batch`).

* ``pending_calls`` (version 2) is the pending-approvals index
  (:mod:`torpor.store.pending`): derived from the log, maintained in the
  append transaction, keyed by the conversation's *text* id so that listing
  waiting conversations in id order is one range scan of its primary key.
* ``idempotency_keys.fingerprint`` (version 2) identifies what a key was
  first used for, so reusing it for something else is refused.
* ``events.hints`` (version 3) holds what the store's hint extractor (compaction's
  topic hints) made of the body at append, opaque here; NULL for rows written
  before it or by a store given no extractor (compaction then extracts them when
  it needs them). Not backfilled: old rows cost what they always did.
* ``fts_backlog`` (version 4) holds the full-text rows of small group-commit
  batches until they are indexed in bulk: an FTS5 index writes a segment at
  every commit that touches it, which doubled the cost of a one-append commit.
  A search first has the backlog of its conversation indexed.
* ``memory_episodes``, ``memory_facts``, ``memory_ledger``, ``memory_turns``
  (version 5) hold derived memory (:mod:`torpor.store.memory`): written at folds
  and by the consolidation sweep, never by an append, never read by revival.
* ``event_vectors`` and ``vector_progress`` (version 6) hold the vectors of
  hybrid recall (:mod:`torpor.store.vectors`), derived from the log: one
  float32 blob per (conversation, vector space, position), and per
  conversation and space the position every event up to which was embedded.
* ``conversations.user_turn``, ``settled_turn``, ``suspended``, ``parked``
  (version 7) are the open-work index (:mod:`torpor.store.open_work`), moved by
  the statement that moves the head; ``conversations_open`` is a partial index
  over the open rows. Backfilled from the log when an older database migrates.
* ``conversations.title``, ``metadata`` (version 8) and the index
  ``conversations_by_activity`` on ``(updated_at, key)`` make the row the
  conversations index (:mod:`torpor.store.listing`); titles are backfilled from
  each conversation's first user message. ``deletions`` (version 8) is the audit of
  removals (:mod:`torpor.store.sqlite.delete`): ids and counts, never content.
* version 9 puts every full-text entry in the normalised form
  (:mod:`torpor.store.normalise`: diacritics folded, digit grouping removed), the form
  appends index and deletes rebuild (:mod:`torpor.store.sqlite.reindex`).

The version lives in ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes the
schema from version ``i`` to ``i + 1`` and runs in the same transaction as the
version bump, so a crash mid-migration leaves the old version intact. A step
is SQL or, where the log must be read (backfilling a derived table), a
function of the connection.

Durability levels are described in :mod:`torpor.store.sqlite.store`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from torpor.errors import StoreError
from torpor.events import Body, decode_body
from torpor.store.arguments import POSITION_LIMIT
from torpor.store.listing import first_title
from torpor.store.open_work import BACKFILL_SELECT, Backfill
from torpor.store.pending import backfill_rows, call_names, named, unnamed
from torpor.store.sqlite.reindex import reindex

__all__ = [
    "INSERT_PENDING",
    "KEY_LIMIT",
    "MIGRATIONS",
    "OPEN_WHERE",
    "PAGE_SIZE",
    "POSITION_LIMIT",
    "SCHEMA_VERSION",
    "Durability",
    "configure_reader",
    "configure_writer",
    "migrate",
]

Durability = Literal["normal", "full"]

KEY_LIMIT = 1 << 31

_V1: Sequence[str] = (
    """
    CREATE TABLE conversations (
        key INTEGER PRIMARY KEY,
        external_id TEXT NOT NULL UNIQUE,
        head INTEGER NOT NULL DEFAULT -1,
        bytes INTEGER NOT NULL DEFAULT 0,
        checkpoint_position INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    )
    """,
    """
    CREATE TABLE events (
        conversation_id INTEGER NOT NULL,
        position INTEGER NOT NULL,
        turn INTEGER NOT NULL,
        kind TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (conversation_id, position)
    )
    """,
    """
    CREATE VIRTUAL TABLE events_fts USING fts5(
        text, content='', columnsize=0, tokenize='unicode61 remove_diacritics 2'
    )
    """,
    "INSERT INTO events_fts(events_fts, rank) VALUES ('automerge', 8)",
    # Index leaves that fit a 1 KiB page (the default, 1,000 bytes, would spill each one
    # into an overflow page); a database made with 4 KiB pages got the default.
    "INSERT INTO events_fts(events_fts, rank) VALUES ('pgsz', 900)",
    """
    CREATE TABLE checkpoints (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL,
        position INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL
    )
    """,
    "CREATE INDEX checkpoints_by_conversation ON checkpoints (conversation_id, id)",
    """
    CREATE TABLE artifacts (
        id TEXT PRIMARY KEY,
        conversation_id INTEGER NOT NULL,
        size INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        data BLOB NOT NULL
    )
    """,
    """
    CREATE TABLE idempotency_keys (
        conversation_id INTEGER NOT NULL,
        key TEXT NOT NULL,
        first_position INTEGER NOT NULL,
        count INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, key)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE model_calls (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL,
        turn INTEGER NOT NULL,
        call_index INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL
    )
    """,
    "CREATE INDEX model_calls_by_turn ON model_calls (conversation_id, turn, call_index)",
)

Step = str | Callable[[sqlite3.Connection], None]

INSERT_PENDING = (
    "INSERT OR REPLACE INTO pending_calls "
    "(conversation, call_id, tool, since, position, ordinal) VALUES (?, ?, ?, ?, ?, ?)"
)


def _indexed_events(conn: sqlite3.Connection) -> Iterator[tuple[str, int, int, Body]]:
    rows = conn.execute(
        "SELECT c.external_id, e.position, e.created_at, e.body FROM events AS e "
        "JOIN conversations AS c ON c.key = e.conversation_id "
        "WHERE e.kind IN ('suspended', 'resolved', 'aborted') "
        "ORDER BY e.conversation_id, e.position"
    )
    for name, position, created_at, body in rows:
        yield name, position, created_at, decode_body(body, conversation_id=name, position=position)


def _backfill_pending(conn: sqlite3.Connection) -> None:
    """The index as the log implies it; tool names of old suspensions from their calls."""
    rows = backfill_rows(_indexed_events(conn))
    names: dict[tuple[str, str], str] = {}
    for name, (latest, calls) in unnamed(rows).items():
        assistants = conn.execute(
            "SELECT e.position, e.body FROM events AS e JOIN conversations AS c "
            "ON c.key = e.conversation_id WHERE c.external_id = ? AND e.kind = 'assistant' "
            "AND e.position < ? ORDER BY e.position DESC",
            (name, latest),
        )
        for position, body in assistants:  # newest first: the call is usually just before
            decoded = decode_body(body, conversation_id=name, position=position)
            for call_id, tool in call_names(decoded):
                if call_id in calls:
                    names[(name, call_id)] = tool
                    calls.discard(call_id)
            if not calls:
                break
    conn.executemany(INSERT_PENDING, named(rows, names))


_V2: Sequence[Step] = (
    "ALTER TABLE idempotency_keys ADD COLUMN fingerprint BLOB",
    """
    CREATE TABLE pending_calls (
        conversation TEXT NOT NULL,
        call_id TEXT NOT NULL,
        tool TEXT NOT NULL,
        since INTEGER NOT NULL,
        position INTEGER NOT NULL,
        ordinal INTEGER NOT NULL,
        PRIMARY KEY (conversation, call_id)
    ) WITHOUT ROWID
    """,
    _backfill_pending,
)

_V3: Sequence[Step] = ("ALTER TABLE events ADD COLUMN hints BLOB",)

_V4: Sequence[Step] = (
    # Full-text rows of small batches, indexed later in bulk (see batch.SearchBacklog).
    "CREATE TABLE fts_backlog (rowid INTEGER PRIMARY KEY, text TEXT NOT NULL)",
)

# Derived memory (torpor.store.memory): episodic and semantic items written at folds, the
# consolidation ledger, and the turns a hot-path reconciler said NONE for. Never the log.
_V5: Sequence[Step] = (
    """
    CREATE TABLE memory_episodes (
        conversation_id INTEGER NOT NULL,
        position INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (conversation_id, position)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE memory_facts (
        conversation_id INTEGER NOT NULL,
        position INTEGER NOT NULL,
        ordinal INTEGER NOT NULL,
        key TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (conversation_id, position, ordinal)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE memory_ledger (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL,
        key TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        body BLOB NOT NULL
    )
    """,
    "CREATE INDEX memory_ledger_by_key ON memory_ledger (conversation_id, key, id)",
    """
    CREATE TABLE memory_turns (
        conversation_id INTEGER NOT NULL,
        turn INTEGER NOT NULL,
        decision TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, turn)
    ) WITHOUT ROWID
    """,
)

_V6: Sequence[Step] = (
    # Hybrid recall's vectors (torpor.store.vectors): derived, never read by the log.
    """
    CREATE TABLE event_vectors (
        conversation_id INTEGER NOT NULL,
        space TEXT NOT NULL,
        position INTEGER NOT NULL,
        vector BLOB NOT NULL,
        PRIMARY KEY (conversation_id, space, position)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE vector_progress (
        conversation_id INTEGER NOT NULL,
        space TEXT NOT NULL,
        position INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, space)
    ) WITHOUT ROWID
    """,
)

# The open-work index (store.open_work): four columns of the conversation row, a partial
# index over the open rows. Columns are added only where missing (a database some test or
# tool took back to an older version may still have them); the backfill sets them all.
_OPEN_COLUMNS = (
    ("user_turn", "INTEGER NOT NULL DEFAULT -1"),
    ("settled_turn", "INTEGER NOT NULL DEFAULT -1"),
    ("suspended", "INTEGER NOT NULL DEFAULT 0"),
    ("parked", "INTEGER NOT NULL DEFAULT 0"),
)
OPEN_WHERE = "user_turn > settled_turn AND suspended = 0 AND parked = 0"


def _open_work(conn: sqlite3.Connection) -> None:
    have = {row[1] for row in conn.execute("PRAGMA table_info(conversations)")}
    for column, declared in _OPEN_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE conversations ADD COLUMN {column} {declared}")
    backfill = Backfill()
    for row in conn.execute(BACKFILL_SELECT):
        backfill.add(*row)
    conn.executemany(
        "UPDATE conversations SET user_turn = ?, settled_turn = ?, suspended = ?, parked = ? "
        "WHERE external_id = ?",
        backfill.rows(),
    )
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS conversations_open ON conversations (external_id) "
        f"WHERE {OPEN_WHERE}"
    )


_V7: Sequence[Step] = (_open_work,)

# The first user message of every conversation, for its default title: one probe of the
# conversation's own events (its primary key, stopping at the first user row), not a scan
# of the log by kind.
TITLE_BACKFILL = (
    "SELECT c.key, (SELECT e.body FROM events AS e WHERE e.conversation_id = c.key "
    "AND e.kind = 'user' ORDER BY e.position LIMIT 1) FROM conversations AS c"
)


def _titles(conn: sqlite3.Connection) -> None:
    have = {row[1] for row in conn.execute("PRAGMA table_info(conversations)")}
    for column in ("title", "metadata"):
        if column not in have:
            conn.execute(f"ALTER TABLE conversations ADD COLUMN {column} TEXT")
    rows = []
    for key, body in conn.execute(TITLE_BACKFILL).fetchall():
        if body is not None:
            title = first_title([decode_body(body, conversation_id=str(key), position=0)])
            rows.append((title, key))
    conn.executemany("UPDATE conversations SET title = ? WHERE key = ?", rows)


# The conversations index (store.listing): title and metadata on the conversation's row,
# an index that pages it by last activity, and the audit of deletions (ids and counts).
_V8: Sequence[Step] = (
    _titles,
    "CREATE INDEX IF NOT EXISTS conversations_by_activity ON conversations (updated_at, key)",
    """
    CREATE TABLE IF NOT EXISTS deletions (
        id INTEGER PRIMARY KEY,
        at INTEGER NOT NULL,
        by TEXT NOT NULL,
        conversations TEXT NOT NULL,
        rows TEXT NOT NULL
    )
    """,
)

# The full-text index in the normalised form (store.normalise: diacritics folded, digit
# grouping removed): the entries that form changes, moved (store.sqlite.reindex).
_V9: Sequence[Step] = (reindex,)

# Schedules (torpor.store.schedules): one row each, keyed by the conversation's key; an
# index on the due time of the pending ones (what the runtime's one timer reads), one per
# conversation, and a conversation's idempotency keys. Self-contained: no backfill.
_SCHEDULES: Sequence[Step] = (
    """
    CREATE TABLE IF NOT EXISTS schedules (
        id TEXT PRIMARY KEY,
        conversation_id INTEGER NOT NULL,
        due INTEGER,
        every INTEGER,
        text TEXT NOT NULL,
        key TEXT,
        fingerprint BLOB,
        created_at INTEGER NOT NULL,
        fired INTEGER NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX IF NOT EXISTS schedules_due ON schedules (due, id) WHERE due IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS schedules_by_conversation ON schedules (conversation_id, due)",
    "CREATE UNIQUE INDEX IF NOT EXISTS schedules_key ON schedules (conversation_id, key) "
    "WHERE key IS NOT NULL",
)

MIGRATIONS: tuple[Sequence[Step], ...] = (
    _V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9, _SCHEDULES
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`; refuse a database from the future."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"database schema version {version} is newer than this torpor "
            f"understands ({SCHEMA_VERSION}); upgrade torpor"
        )
    while version < SCHEMA_VERSION:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for step in MIGRATIONS[version]:
                if isinstance(step, str):
                    conn.execute(step)
                else:
                    step(conn)
            version += 1
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    return version


def _common(conn: sqlite3.Connection, busy_ms: int) -> None:
    # How long a statement waits for another process's lock before SQLITE_BUSY
    # (then StoreUnavailable): a writer elsewhere holding the file.
    conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    conn.execute("PRAGMA temp_store = MEMORY")
    # Deleted content is overwritten with zeros, so a deleted conversation's text is not
    # left in freed pages (search-backlog flushes and index merges delete too).
    conn.execute("PRAGMA secure_delete = ON")
    conn.execute("PRAGMA cache_size = -32768")  # 32 MiB per connection


PAGE_SIZE = 1024
"""The page size of a database this store creates (see :func:`configure_writer`)."""


def configure_writer(
    conn: sqlite3.Connection,
    durability: Durability,
    *,
    file: bool,
    busy_ms: int = 10_000,
    wal_keep: int | None = None,
) -> None:
    """The writer connection. A file store's WAL is checkpointed by the store's
    checkpointer (:mod:`.checkpoint`), never inside a commit: automatic
    checkpoints are off, and ``wal_keep`` (bytes, ``journal_size_limit``) is
    what is kept of the WAL file when it starts over.
    """
    _common(conn, busy_ms)
    if file:
        if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
            # A new database: small pages. A commit writes every page it changed, whole,
            # to the WAL; a chat append changes a few rows in a few tables, so WAL bytes
            # (and with them checkpoints, the slowest turns' cause) scale with the page
            # size: 1 KiB pages write a third of the WAL 4 KiB pages do, per turn.
            # Fixed for the database's life (an existing one keeps its own).
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"could not switch the database to WAL mode (got {mode!r})")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        if wal_keep is not None:
            conn.execute(f"PRAGMA journal_size_limit = {int(wal_keep)}")
    conn.execute(f"PRAGMA synchronous = {durability.upper()}")


def configure_reader(conn: sqlite3.Connection, busy_ms: int = 10_000) -> None:
    _common(conn, busy_ms)
    conn.execute("PRAGMA mmap_size = 268435456")
    conn.execute("PRAGMA query_only = 1")
