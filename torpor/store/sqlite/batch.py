"""One group-commit transaction on the writer thread: plan every operation, then write.

Each operation is first *planned*: validated against the conversation heads as
this batch sees them (expect_head, idempotency keys, checkpoint bounds) and
turned into the rows it will write, without touching the database. An
operation that is refused (a conflict, a bad checkpoint) fails alone, having
written nothing, and the next operation plans against the heads without it.

Then the rows of all planned operations are written together, one
``executemany`` per statement: far fewer Python-to-SQLite calls than a
statement per row, which is what brings group commit near raw ``executemany``
speed. If that bulk write fails (it should not: the plans were validated), the
whole transaction is rolled back and the batch is replayed in *isolated* mode:
each operation planned and written inside its own SAVEPOINT, so the one that
fails is rolled back alone and reported to its caller only.

If the bulk write fails because the database cannot write at all (disk full,
read-only, I/O error, locked past the busy timeout: see :mod:`.errors`), there
is no culprit to find: the transaction is rolled back (SQLite may already have
done so itself) and every operation of the batch gets the same
StoreUnavailable. Nothing of the batch is committed; the connection stays
usable, so the next batch succeeds once the condition clears.

Full-text rows are inserted last and in rowid order: FTS5 flushes its pending
in-memory index whenever a rowid goes backwards, and interleaved conversations
would otherwise make it flush after almost every row. A small batch does not
index at all: FTS5 writes a new segment at every COMMIT that touched the index,
which was half the cost of a one-append transaction and half its WAL pages, so
its rows go to ``fts_backlog`` (a plain table, same transaction, so nothing is
lost in a crash) and are indexed together later, in one segment (see
:class:`SearchBacklog`). The pending-approvals
index is written last too, from the net effect of the batch's kept plans
(:class:`~torpor.store.pending.PendingChanges`), so statement grouping cannot
reorder an insertion and a deletion of the same row.

Heads live in :class:`HeadCache` on this thread. A batch sees them through its
own overlay, and the cache learns the new heads only after COMMIT succeeds, so
a rollback can never leave a wrong head behind. The event loop may only make
it forget a head (a hibernating agent's: the next append reads it again).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from torpor.errors import StoreError
from torpor.events import Body
from torpor.store.commit_queue import Failed
from torpor.store.open_work import WorkChange, compose
from torpor.store.pending import PendingChanges
from torpor.store.sqlite.errors import UNAVAILABLE, primary_code, store_error
from torpor.store.sqlite.schema import INSERT_PENDING, KEY_LIMIT

__all__ = [
    "Batch",
    "ConvState",
    "Failed",
    "FlushSearchIndex",
    "HeadCache",
    "Plan",
    "SearchBacklog",
    "WriteOp",
    "run_batch",
]

Row = tuple[object, ...]


class ConvState(msgspec.Struct, frozen=True, gc=False):
    key: int  # integer surrogate stored in events.conversation_id
    head: int  # last position, -1 when empty
    stored: bool = True  # False: the key is allocated but the row not yet written


class HeadCache:
    """Committed conversation states, most recently used last.

    Used by the writer thread, and forgotten from the event loop too (a hibernating
    agent's entry, see ``GroupCommitWriter.forget_head``): a lock keeps each method whole.
    Forgetting is always safe: a miss reads the head from the database.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._states: OrderedDict[str, ConvState] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> ConvState | None:
        with self._lock:
            state = self._states.get(name)
            if state is not None:
                self._states.move_to_end(name)
            return state

    def absorb(self, states: dict[str, ConvState]) -> None:
        with self._lock:
            for name, state in states.items():
                self._states[name] = state
                self._states.move_to_end(name)
            while len(self._states) > self._capacity:
                self._states.popitem(last=False)

    def forget(self, name: str) -> None:
        with self._lock:
            self._states.pop(name, None)
            if not self._states:  # an OrderedDict never shrinks: after a burst it would stay
                self._states = OrderedDict()


class Plan(msgspec.Struct, gc=False):
    """What one operation will write, and what its caller gets once that is committed."""

    result: object
    name: str | None = None  # the conversation whose head this operation moves
    state: ConvState | None = None  # that conversation's state afterwards
    writes: list[tuple[str, Row]] = msgspec.field(default_factory=list)
    fts: list[tuple[int, str]] = msgspec.field(default_factory=list)
    added_bytes: int = 0
    # (conversation key, idempotency key) -> (first position, count, prepared events,
    # fingerprint)
    idempotency: tuple[tuple[int, str], tuple[int, int, object, bytes | None]] | None = None
    indexed: list[tuple[int, int, Body]] | None = None  # (position, created_at, body) to index
    work: WorkChange | None = None  # its change to the open-work index (store.open_work)
    title: str | None = None  # the default title it brings (kept if the row has one)


class WriteOp(Protocol):
    @property
    def conversation_id(self) -> str: ...

    def plan(self, batch: Batch) -> Plan: ...


_INSERT_CONVERSATION = (
    "INSERT INTO conversations (key, external_id, created_at, updated_at) VALUES (?, ?, ?, ?)"
)
# On a cache miss the head comes from the events themselves (the truth), not from the
# denormalised conversations.head, so a stale row can never make positions collide.
_READ_STATE = (
    "SELECT key, coalesce((SELECT max(position) FROM events WHERE conversation_id = key), -1)"
    " FROM conversations WHERE external_id = ?"
)
_UPDATE_HEAD = "UPDATE conversations SET head = ?, bytes = bytes + ?, updated_at = ? WHERE key = ?"
# An append with a user message also gives a conversation without a title its default one.
_UPDATE_HEAD_TITLE = (
    "UPDATE conversations SET head = ?, bytes = bytes + ?, updated_at = ?, "
    "user_turn = max(user_turn, ?), settled_turn = max(settled_turn, ?), "
    "suspended = coalesce(nullif(?, -1), suspended), parked = coalesce(nullif(?, -1), parked), "
    "title = coalesce(title, ?) WHERE key = ?"
)
# With the open-work index's columns (store.open_work; -1 keeps each), for the conversations
# whose appends move them: the others (tool results, steps with tool calls) do not pay for it.
_UPDATE_HEAD_WORK = (
    "UPDATE conversations SET head = ?, bytes = bytes + ?, updated_at = ?, "
    "user_turn = max(user_turn, ?), settled_turn = max(settled_turn, ?), "
    "suspended = coalesce(nullif(?, -1), suspended), parked = coalesce(nullif(?, -1), parked) "
    "WHERE key = ?"
)


class Batch:
    """One transaction's view of the conversations, and the rows planned so far."""

    def __init__(self, conn: sqlite3.Connection, cache: HeadCache, now: int) -> None:
        self.conn = conn
        self.now = now
        self._cache = cache
        self.states: dict[str, ConvState] = {}  # as of the operations planned so far
        # idempotency keys planned in this batch
        self.keys: dict[tuple[int, str], tuple[int, int, object, bytes | None]] = {}
        self.pending = PendingChanges()
        self._next_key: int | None = None
        # key -> [head, added bytes, open-work change, default title]
        self._heads: dict[int, list[Any]] = {}
        self.fts: list[tuple[int, str]] = []
        self.flush_search = False  # index the search backlog in this transaction
        self.backlog = (0, 0)  # the search backlog's (rows, text bytes) once this commits
        # Schedules changed by the operations planned so far (store.sqlite.schedule_ops):
        # what a later one in the batch must see before any of it is written.
        self.schedules: dict[tuple[object, ...], Any] = {}

    def conversation(self, name: str) -> ConvState:
        """The conversation as this batch sees it; a new one gets a key but no row yet."""
        state = self.states.get(name) or self._cache.get(name)
        if state is not None:
            return state
        row = self.conn.execute(_READ_STATE, (name,)).fetchone()
        if row is not None:
            state = ConvState(int(row[0]), int(row[1]))
        else:
            state = ConvState(self._allocate_key(), -1, stored=False)
        self.states[name] = state
        return state

    def _allocate_key(self) -> int:
        if self._next_key is None:
            row = self.conn.execute("SELECT coalesce(max(key), 0) FROM conversations").fetchone()
            self._next_key = int(row[0]) + 1
        key = self._next_key
        if key >= KEY_LIMIT:
            raise StoreError(f"conversation key space exhausted (key {key})")
        self._next_key += 1
        return key

    def creating(self, name: str, state: ConvState) -> list[tuple[str, Row]]:
        """The row a plan must write first if its conversation does not exist yet."""
        if state.stored:
            return []
        return [(_INSERT_CONVERSATION, (state.key, name, self.now, self.now))]

    def keep(self, plan: Plan) -> None:
        """Make a planned (isolated mode: written) operation visible to the next ones."""
        if plan.name is not None and plan.state is not None:
            self.states[plan.name] = plan.state
            if plan.added_bytes:  # an append: the conversation row gets its new head
                entry = self._heads.setdefault(plan.state.key, [plan.state.head, 0, None, None])
                entry[0] = plan.state.head
                entry[1] += plan.added_bytes
                if plan.work is not None:
                    entry[2] = compose(entry[2], plan.work)
                    if entry[3] is None:
                        entry[3] = plan.title
        self.fts.extend(plan.fts)
        if plan.idempotency is not None:
            self.keys[plan.idempotency[0]] = plan.idempotency[1]
        if plan.indexed is not None and plan.name is not None:
            for position, created_at, body in plan.indexed:
                self.pending.apply(plan.name, position, created_at, body)

    def forget(self, name: str) -> None:
        """Our idea of this conversation may be wrong: read it from the database next time."""
        self.states.pop(name, None)
        self._cache.forget(name)

    def head_updates(self) -> tuple[list[Row], list[Row], list[Row]]:
        """Rows of ``_UPDATE_HEAD``, ``_UPDATE_HEAD_WORK`` and ``_UPDATE_HEAD_TITLE``."""
        plain: list[Row] = []
        moving: list[Row] = []
        titled: list[Row] = []
        now = self.now
        for key, (head, size, work, title) in self._heads.items():
            if work is None:
                plain.append((head, size, now, key))
            elif title is None:
                moving.append((head, size, now, *work, key))
            else:
                titled.append((head, size, now, *work, title, key))
        return plain, moving, titled

    def committed(self) -> dict[str, ConvState]:
        return {name: state for name, state in self.states.items() if state.stored}


class SearchBacklog:
    """Rows of ``fts_backlog``: written, not yet in ``events_fts``; writer thread only.

    A batch with few full-text rows appends them to the backlog. One with many
    (``direct_rows``) or much text (``direct_bytes``), one that brings the
    backlog to ``flush_rows`` rows or ``flush_bytes`` of text, and one asked to
    (:class:`FlushSearchIndex`, sent by ``search`` when the backlog holds rows
    of its conversation) indexes the backlog and its own rows together, in
    rowid order. ``size`` is (rows, text bytes) as of the last COMMIT; a batch
    learns its new value only once it has committed.
    """

    def __init__(
        self,
        size: tuple[int, int] = (0, 0),
        *,
        direct_rows: int = 64,
        direct_bytes: int = 64 * 1024,
        flush_rows: int = 512,
        flush_bytes: int = 256 * 1024,
    ) -> None:
        self.size = size
        self._direct_rows = direct_rows
        self._direct_bytes = direct_bytes
        self._flush_rows = flush_rows
        self._flush_bytes = flush_bytes

    def indexes(self, rows: int, text: int) -> bool:
        """Whether a batch of ``rows`` full-text rows (``text`` characters) indexes them
        and the backlog now (the costly case) instead of adding them to the backlog."""
        count, size = self.size
        return (
            rows >= self._direct_rows
            or text >= self._direct_bytes
            or count + rows >= self._flush_rows
            or size + text >= self._flush_bytes
        )

    def write(
        self, conn: sqlite3.Connection, rows: list[tuple[int, str]], flush: bool
    ) -> tuple[int, int]:
        """Write ``rows`` (to the index or the backlog); the backlog's size once this commits."""
        count, size = self.size
        if not rows and not (flush and count):
            return self.size
        text = sum(len(t) for _, t in rows)
        if flush or self.indexes(len(rows), text):
            if count:
                rows = rows + conn.execute("SELECT rowid, text FROM fts_backlog").fetchall()
                conn.execute("DELETE FROM fts_backlog")
            rows.sort()
            conn.executemany("INSERT INTO events_fts (rowid, text) VALUES (?, ?)", rows)
            return (0, 0)
        conn.executemany("INSERT INTO fts_backlog (rowid, text) VALUES (?, ?)", rows)
        return (count + len(rows), size + text)


@dataclass(frozen=True, slots=True)
class FlushSearchIndex:
    """Index the whole backlog in the next commit (a no-op when it is empty)."""

    conversation_id: str = ""

    def plan(self, batch: Batch) -> Plan:
        batch.flush_search = True
        return Plan(None)


def run_batch(
    conn: sqlite3.Connection,
    cache: HeadCache,
    backlog: SearchBacklog,
    ops: Sequence[WriteOp],
    now: int,
) -> tuple[list[object], BaseException | None]:
    """Commit ``ops`` in one transaction: each one's result or :class:`Failed`, in order.

    Never raises: when the whole transaction fails (nothing of it committed)
    every operation gets a :class:`Failed` and the cause comes back as the
    second item, for the writer to log and to decide whether the connection
    must be replaced. Runs on the writer thread.
    """
    try:
        try:
            batch, results = _attempt(conn, cache, backlog, ops, now, _write_bulk)
        except Exception as exc:
            if _unavailable(exc):  # nobody's fault but the database's: fail them all
                raise
            _rollback(conn)  # the bulk write failed: find the culprit, one op at a time
            for op in ops:
                cache.forget(op.conversation_id)
            batch, results = _attempt(conn, cache, backlog, ops, now, None)
    except BaseException as exc:
        _rollback(conn)
        for op in ops:
            cache.forget(op.conversation_id)
        return [Failed(_batch_error(len(ops), exc)) for _ in ops], exc
    cache.absorb(batch.committed())
    backlog.size = batch.backlog
    return results, None


Writer = Callable[[sqlite3.Connection, list[Plan]], None]


def _attempt(
    conn: sqlite3.Connection,
    cache: HeadCache,
    backlog: SearchBacklog,
    ops: Sequence[WriteOp],
    now: int,
    bulk: Writer | None,
) -> tuple[Batch, list[object]]:
    """One try at the transaction: bulk (``bulk`` given) or isolated (each op in a SAVEPOINT)."""
    batch = Batch(conn, cache, now)
    results: list[object] = []
    plans: list[Plan] = []
    conn.execute("BEGIN IMMEDIATE")
    for op in ops:
        if bulk is None:
            conn.execute("SAVEPOINT op")
        try:
            plan = op.plan(batch)
            if bulk is None:
                for sql, row in plan.writes:
                    conn.execute(sql, row)
        except Exception as exc:
            if isinstance(exc, sqlite3.Error) and (bulk is not None or _unavailable(exc)):
                raise  # the whole batch fails (bulk: replayed in isolation; else: for all)
            if bulk is None:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
            if isinstance(exc, sqlite3.Error):
                batch.forget(op.conversation_id)
                exc = store_error(exc, f"write to {op.conversation_id!r} failed")
            results.append(Failed(exc))
            continue
        if bulk is None:
            conn.execute("RELEASE op")
        batch.keep(plan)
        plans.append(plan)
        results.append(plan.result)
    if bulk is not None:
        bulk(conn, plans)
    plain, moving, titled = batch.head_updates()
    if plain:
        conn.executemany(_UPDATE_HEAD, plain)
    if moving:
        conn.executemany(_UPDATE_HEAD_WORK, moving)
    if titled:
        conn.executemany(_UPDATE_HEAD_TITLE, titled)
    batch.backlog = backlog.write(conn, batch.fts, batch.flush_search)
    if batch.pending:
        _write_pending(conn, batch.pending)
    conn.execute("COMMIT")
    return batch, results


def _write_pending(conn: sqlite3.Connection, changes: PendingChanges) -> None:
    """Clear, then remove, then insert: the order the net changes are defined in."""
    cleared = changes.cleared()
    if cleared:
        conn.executemany(
            "DELETE FROM pending_calls WHERE conversation = ?", [(name,) for name in cleared]
        )
    removed = changes.removed()
    if removed:
        conn.executemany(
            "DELETE FROM pending_calls WHERE conversation = ? AND call_id = ?", removed
        )
    inserted = changes.inserted()
    if inserted:
        conn.executemany(INSERT_PENDING, inserted)


def _write_bulk(conn: sqlite3.Connection, plans: list[Plan]) -> None:
    grouped: dict[str, list[Row]] = {}
    for plan in plans:
        for sql, row in plan.writes:
            rows = grouped.get(sql)
            if rows is None:
                grouped[sql] = [row]
            else:
                rows.append(row)
    for sql, rows in grouped.items():
        if len(rows) == 1:
            conn.execute(sql, rows[0])
        else:
            conn.executemany(sql, rows)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) and primary_code(exc) in UNAVAILABLE


def _batch_error(size: int, cause: BaseException) -> StoreError:
    if isinstance(cause, sqlite3.Error):
        return store_error(cause, f"group commit of {size} operations failed")
    error = StoreError(f"group commit of {size} operations failed: {cause!r}")
    error.__cause__ = cause
    return error
