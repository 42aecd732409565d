"""The operations the writer commits, each planned against a :class:`Batch`.

A plan reads (heads, idempotency keys) but never writes: it returns the rows
to write and the caller's result, or raises to refuse the operation. See
:mod:`.batch` for how plans become one transaction.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgspec

from torpor.errors import ConflictError, IdempotencyConflict, StoreError, UnknownConversation
from torpor.events import Body, Event
from torpor.store.admit import check_checkpoint_reach
from torpor.store.commit_queue import Failed
from torpor.store.pending import INDEXED_KINDS
from torpor.store.prepare import PreparedAppend, PreparedEvent
from torpor.store.protocol import Checkpoint, ModelCall
from torpor.store.rows import (
    EVENT_COLUMNS,
    check_reaches,
    compress_artifact,
    encode_checkpoint,
    encode_model_call,
    to_events,
)
from torpor.store.sqlite.batch import Batch, ConvState, Plan
from torpor.store.sqlite.schedule_ops import firing_writes
from torpor.store.sqlite.schema import POSITION_LIMIT

__all__ = ["AppendOp", "ArtifactOp", "CheckpointOp", "DescribeOp", "ModelCallOp"]


INSERT_EVENT = (
    "INSERT INTO events (conversation_id, position, turn, kind, tokens, created_at, body, hints) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT_MODEL_CALL = (
    "INSERT INTO model_calls (conversation_id, turn, call_index, created_at, body) "
    "VALUES (?, ?, ?, ?, ?)"
)
INSERT_ARTIFACT = (
    "INSERT INTO artifacts (id, conversation_id, size, created_at, data) VALUES (?, ?, ?, ?, ?)"
)
INSERT_KEY = (
    "INSERT INTO idempotency_keys "
    "(conversation_id, key, first_position, count, created_at, fingerprint) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
# The key's first use, and (for a key stored before fingerprints) its first body.
_READ_KEY = (
    "SELECT i.first_position, i.count, i.fingerprint, "
    "CASE WHEN i.fingerprint IS NULL THEN e.body END FROM idempotency_keys AS i "
    "LEFT JOIN events AS e ON e.conversation_id = i.conversation_id "
    "AND e.position = i.first_position WHERE i.conversation_id = ? AND i.key = ?"
)


class AppendOp(msgspec.Struct, frozen=True, gc=False):
    """Append events; the result is their positions, or the stored events if ``with_events``."""

    append: PreparedAppend
    with_events: bool = False
    audit: ModelCall | None = None  # the model call behind the events: its row too

    @property
    def conversation_id(self) -> str:
        return self.append.conversation_id

    def plan(self, batch: Batch) -> Plan:
        append = self.append
        name = append.conversation_id
        state = batch.conversation(name)
        if append.key is not None and state.stored:
            replay = self._replay(batch, state.key, append.key)
            if replay is not None:
                return Plan(replay)
        if append.expect_head is not None and append.expect_head != state.head:
            conflict = ConflictError(name, append.expect_head, state.head)
            if self.audit is None or not state.stored:  # (deleted: nothing to record it in)
                raise conflict
            # The model call behind the answer was made (and paid for): its row is written
            # as record_model_call would write it; only the answer is refused.
            recorded = ModelCallOp(self.audit).plan(batch)
            return Plan(Failed(conflict), recorded.name, recorded.state, recorded.writes)
        events = append.events
        first = state.head + 1
        last = first + len(events) - 1
        if last >= POSITION_LIMIT:
            raise StoreError(f"conversation {name!r} is full (position {last})")
        key = state.key
        base = key << 32  # the search index's rowid: conversation key, then position
        moved = None
        if append.fired is not None:  # last check: it records the move in the batch
            moved = firing_writes(batch, name, key, append.fired, state.stored)
        writes = batch.creating(name, state)
        if moved is not None:
            writes.extend(moved)
        fts: list[tuple[int, str]] = []
        size = 0
        indexed: list[tuple[int, int, Body]] | None = None
        position = first
        for e in events:  # one pass builds every row of the event (a hot loop: no helpers)
            size += len(e.body)
            row = (key, position, e.turn, e.kind, e.tokens, e.created_at, e.body, e.hints)
            writes.append((INSERT_EVENT, row))
            if e.artifact_id is not None and e.artifact_data is not None:
                data = compress_artifact(e.artifact_data)
                stored = (e.artifact_id, key, len(e.artifact_data), e.created_at, data)
                writes.append((INSERT_ARTIFACT, stored))
            if e.kind in INDEXED_KINDS:
                if indexed is None:
                    indexed = []
                indexed.append((position, e.created_at, e.value))
            if e.text:
                fts.append((base | position, e.text))
            position += 1
        mark = append.fingerprint
        idempotency = None
        if append.key is not None:
            writes.append((INSERT_KEY, (key, append.key, first, len(events), batch.now, mark)))
            idempotency = ((key, append.key), (first, len(events), events, mark))
        if self.audit is not None:
            writes.append((INSERT_MODEL_CALL, _model_call_row(key, self.audit)))
        result = append.result(first, events, self.with_events)
        return Plan(
            result, name, ConvState(key, last), writes, fts, size, idempotency, indexed,
            append.work, append.title,
        )

    def _result(self, first: int, events: tuple[PreparedEvent, ...]) -> list[Any]:
        return self.append.result(first, events, self.with_events)

    def _replay(self, batch: Batch, key: int, idem: str) -> list[Any] | None:
        """The first append with this key, if there was one: its positions or events.

        Raises IdempotencyConflict if that append was not this one (other bodies).
        """
        append = self.append
        planned = batch.keys.get((key, idem))
        if planned is not None:
            first, _, events, mark = planned
            assert isinstance(events, tuple)
            if mark != append.fingerprint:
                raise IdempotencyConflict(append.conversation_id, idem)
            return self._result(first, events)
        row = batch.conn.execute(_READ_KEY, (key, idem)).fetchone()
        if row is None:
            return None
        first, count, stored_mark, first_body = int(row[0]), int(row[1]), row[2], row[3]
        if not append.repeats(stored_mark, first_body):
            raise IdempotencyConflict(append.conversation_id, idem)
        if not self.with_events:
            return list(range(first, first + count))
        return _read_events(batch.conn, append.conversation_id, key, first, count)


def _read_events(
    conn: sqlite3.Connection, name: str, key: int, first: int, count: int
) -> list[Event]:
    last = first + count - 1
    rows = conn.execute(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE conversation_id = ? "
        "AND position BETWEEN ? AND ? ORDER BY position",
        (key, first, last),
    )
    events = to_events(name, rows, first)
    check_reaches(name, events, first, last)
    return events


class CheckpointOp(msgspec.Struct, frozen=True, gc=False):
    checkpoint: Checkpoint

    @property
    def conversation_id(self) -> str:
        return self.checkpoint.conversation_id

    def plan(self, batch: Batch) -> Plan:
        cp = self.checkpoint
        state = batch.conversation(cp.conversation_id)
        _existing(cp.conversation_id, state, "checkpoint")
        check_checkpoint_reach(cp, state.head)
        writes: list[tuple[str, Any]] = []
        writes.append(
            (
                "INSERT INTO checkpoints (conversation_id, position, created_at, body) "
                "VALUES (?, ?, ?, ?)",
                (state.key, cp.position, cp.created_at, encode_checkpoint(cp)),
            )
        )
        writes.append(
            (
                "UPDATE conversations SET checkpoint_position = ?, updated_at = ? WHERE key = ?",
                (cp.position, batch.now, state.key),
            )
        )
        return Plan(None, cp.conversation_id, ConvState(state.key, state.head), writes)


class ArtifactOp(msgspec.Struct, frozen=True, gc=False):
    conversation_id: str
    artifact_id: str
    data: bytes

    def plan(self, batch: Batch) -> Plan:
        state = batch.conversation(self.conversation_id)
        _existing(self.conversation_id, state, "artifact")
        writes: list[tuple[str, Any]] = []
        row = (self.artifact_id, state.key, len(self.data), batch.now, compress_artifact(self.data))
        writes.append((INSERT_ARTIFACT, row))
        return Plan(
            self.artifact_id, self.conversation_id, ConvState(state.key, state.head), writes
        )


class ModelCallOp(msgspec.Struct, frozen=True, gc=False):
    call: ModelCall

    @property
    def conversation_id(self) -> str:
        return self.call.conversation_id

    def plan(self, batch: Batch) -> Plan:
        call = self.call
        state = batch.conversation(call.conversation_id)
        _existing(call.conversation_id, state, "model call")
        writes: list[tuple[str, Any]] = []
        writes.append((INSERT_MODEL_CALL, _model_call_row(state.key, call)))
        return Plan(None, call.conversation_id, ConvState(state.key, state.head), writes)


def _existing(name: str, state: ConvState, what: str) -> None:
    """Only an append creates a conversation: a write that hangs something on one (a
    checkpoint, an artifact, a model call's audit) racing its delete must not bring
    back an empty row of it (torpor.runtime.erase)."""
    if not state.stored:
        raise UnknownConversation(f"no conversation {name!r} for the {what}")


def _model_call_row(key: int, call: ModelCall) -> tuple[int, int, int, int, bytes]:
    """The ``model_calls`` row of ``call`` in the conversation with surrogate ``key``."""
    return (key, call.turn, call.call_index, call.created_at, encode_model_call(call))


_DESCRIBE = (
    "UPDATE conversations SET title = coalesce(?, title), metadata = coalesce(?, metadata) "
    "WHERE key = ?"
)


class DescribeOp(msgspec.Struct, frozen=True, gc=False):
    """Set a conversation's title and/or metadata (JSON text); None leaves each as it is.
    The result: whether the conversation exists (an unknown one is not created)."""

    conversation_id: str
    title: str | None
    metadata: str | None

    def plan(self, batch: Batch) -> Plan:
        state = batch.conversation(self.conversation_id)
        if not state.stored:
            return Plan(False)
        return Plan(True, writes=[(_DESCRIBE, (self.title, self.metadata, state.key))])
