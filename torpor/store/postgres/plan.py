"""The operations the PostgreSQL writer commits, planned without touching the database.

A batch first locks and reads the conversations it touches (:mod:`.batch`),
then every operation is *planned* against that :class:`View`: validated
(expect_head, idempotency keys, checkpoint bounds) and turned into the rows it
will write. Planning is pure, so when the batch learns something new (another
process created a conversation between our read and our insert) it simply
plans again. A refused operation fails alone and the next one plans against
the heads without it, exactly like the SQLite writer.

Rows name their conversation by its text id; the integer keys are filled in
when the rows are written, because a conversation created by this batch has no
key until its row is inserted (and it is only inserted if some plan needs it:
a refused append creates nothing).

Work that needs no database (search documents, artifact compression) is done
when the operation is built, on the caller's side, not while a batch holds
conversation locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from torpor.errors import (
    ConflictError,
    FencedError,
    IdempotencyConflict,
    ScheduleGone,
    StoreError,
    UnknownConversation,
)
from torpor.events import Body
from torpor.store.admit import check_checkpoint_reach
from torpor.store.arguments import POSITION_LIMIT
from torpor.store.commit_queue import Failed
from torpor.store.open_work import WorkChange, compose
from torpor.store.pending import INDEXED_KINDS, PendingChanges
from torpor.store.postgres.lexemes import document_chunks
from torpor.store.prepare import PreparedAppend, PreparedEvent
from torpor.store.protocol import Checkpoint, ModelCall
from torpor.store.rows import compress_artifact, encode_checkpoint, encode_model_call
from torpor.store.schedules import Firing

__all__ = [
    "AppendOp",
    "ArtifactOp",
    "CheckpointOp",
    "ConvState",
    "HeadUpdate",
    "ModelCallOp",
    "Plan",
    "ReplayEvents",
    "View",
    "WriteOp",
    "Writes",
    "check_fence",
]


class ConvState(msgspec.Struct, frozen=True, gc=False):
    key: int | None  # None: no row yet (inserted only if a kept plan needs it)
    head: int  # last position, -1 when empty


NEW = ConvState(None, -1)


@dataclass(slots=True)
class HeadUpdate:
    head: int
    added_bytes: int = 0
    checkpoint: int | None = None
    work: WorkChange | None = None  # the open-work index's change (store.open_work)
    title: str | None = None  # the default title (kept where the row has one)


@dataclass(slots=True)
class Writes:
    """Rows to insert, per table; conversations named by text id."""

    # (conversation, position, turn, kind, tokens, created_at, body, hints, epoch)
    events: list[tuple[str, int, int, str, int, int, bytes, bytes | None, int | None]] = field(
        default_factory=list
    )
    fts: list[tuple[str, int, int, str, str]] = field(default_factory=list)
    artifacts: list[tuple[str, str, int, int, bytes]] = field(default_factory=list)
    keys: list[tuple[str, str, int, int, int, bytes | None]] = field(default_factory=list)
    checkpoints: list[tuple[str, int, int, bytes]] = field(default_factory=list)
    model_calls: list[tuple[str, int, int, int, bytes]] = field(default_factory=list)
    # (schedule id, next due or None, delete the row): schedules fired (store.schedules)
    schedules: list[tuple[str, int | None, bool]] = field(default_factory=list)

    def extend(self, other: Writes) -> None:
        self.events.extend(other.events)
        self.fts.extend(other.fts)
        self.artifacts.extend(other.artifacts)
        self.keys.extend(other.keys)
        self.checkpoints.extend(other.checkpoints)
        self.model_calls.extend(other.model_calls)
        self.schedules.extend(other.schedules)


@dataclass(frozen=True, slots=True)
class ReplayEvents:
    """A keyed append seen in an earlier batch: its stored events are read after planning."""

    conversation_id: str
    first: int
    count: int


PlannedKey = tuple[int, int, tuple[PreparedEvent, ...], bytes | None]
"""A key planned in this batch: first position, count, prepared events, fingerprint."""

StoredKey = tuple[int, int, bytes | None, bytes | None]
"""A key found in the database: first position, count, fingerprint, and (only for a key
stored before fingerprints) the first body."""


@dataclass(slots=True)
class Plan:
    result: object
    name: str | None = None  # the conversation this operation needs to exist
    head: HeadUpdate | None = None  # how it moves that conversation's row
    writes: Writes | None = None
    # (conversation, idempotency key) -> what was planned for it
    idempotency: tuple[tuple[str, str], PlannedKey] | None = None
    indexed: list[tuple[int, int, Body]] | None = None  # (position, created_at, body) to index


class WriteOp(Protocol):
    @property
    def conversation_id(self) -> str: ...

    @property
    def idempotency_key(self) -> str | None: ...

    def plan(self, view: View) -> Plan: ...


class View:
    """The locked conversations as one batch sees them, plus what it planned so far."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.states: dict[str, ConvState] = {}  # read (and locked) from the database
        self.stored_keys: dict[tuple[str, str], StoredKey] = {}
        self.creating = False  # the batch has started creating conversations
        self.epochs: dict[int, int] = {}  # shard -> current lease epoch (fenced batches only)
        self.shards: dict[str, int] = {}  # conversation -> shard, for rows this batch creates
        # schedule id -> (conversation, due, key) of the schedules the batch fires, locked
        self.schedules: dict[str, tuple[str, int | None, str | None]] = {}
        self.begin()

    def begin(self) -> None:
        """Forget every plan (to plan the batch again)."""
        self.planned: dict[str, ConvState] = {}
        self.planned_keys: dict[tuple[str, str], PlannedKey] = {}
        self.heads: dict[str, HeadUpdate] = {}
        self.writes = Writes()
        self.pending = PendingChanges()  # the pending-approvals index, net of the batch
        self.fired: set[str] = set()  # schedules fired by the plans kept so far

    def state(self, name: str) -> ConvState:
        return self.planned.get(name) or self.states.get(name) or NEW

    def existing(self, name: str, what: str) -> None:
        """Only an append creates a conversation: a write that hangs something on one (a
        checkpoint, an artifact, a model call's audit) racing its delete must not bring
        back an empty row of it (torpor.runtime.erase). Its row was read locked (the
        delete locks it too), so a delete cannot land between this check and the write."""
        if name not in self.planned and name not in self.states:
            raise UnknownConversation(f"no conversation {name!r} for the {what}")

    def keep(self, plan: Plan) -> None:
        """Make a plan visible to the operations after it."""
        if plan.writes is not None:
            self.writes.extend(plan.writes)
            self.fired.update(sid for sid, _, _ in plan.writes.schedules)
        if plan.idempotency is not None:
            self.planned_keys[plan.idempotency[0]] = plan.idempotency[1]
        if plan.name is None:
            return
        if plan.indexed is not None:
            for position, created_at, body in plan.indexed:
                self.pending.apply(plan.name, position, created_at, body)
        state = self.state(plan.name)
        update = plan.head
        if update is not None:
            state = ConvState(state.key, update.head)
            merged = self.heads.get(plan.name)
            if merged is None:
                self.heads[plan.name] = HeadUpdate(
                    update.head, update.added_bytes, update.checkpoint, update.work, update.title
                )
            else:
                merged.head = update.head
                merged.added_bytes += update.added_bytes
                if update.checkpoint is not None:
                    merged.checkpoint = update.checkpoint
                merged.work = compose(merged.work, update.work)
                if merged.title is None:
                    merged.title = update.title
        self.planned[plan.name] = state

    def needed(self) -> list[str]:
        """Conversations some kept plan writes to that have no row yet, sorted."""
        return sorted(name for name in self.planned if name not in self.states)

    def created(self, keys: dict[str, int]) -> None:
        for name, key in keys.items():
            self.states[name] = ConvState(key, -1)

    def key_of(self, name: str) -> int:
        state = self.states.get(name)
        if state is None or state.key is None:
            raise AssertionError(f"conversation {name!r} was planned but never created")
        return state.key


def check_fence(view: View, name: str, fence: tuple[int, int] | None) -> int | None:
    """The epoch an op of a clustered node writes under, refused if no longer current.

    Every write of a node is fenced, not only appends: a stale owner's checkpoint
    would become the latest one (checkpoints are ordered by insertion) and regress
    revival to an older fold; its model-call and artifact rows would land after
    another node took the conversation over.
    """
    if fence is None:
        return None
    shard, epoch = fence
    if view.epochs.get(shard) != epoch:
        raise FencedError(name, shard, epoch)
    view.shards[name] = shard
    return epoch


def _fire(view: View, name: str, fired: Firing) -> tuple[str, int | None, bool]:
    """The move of a schedule an append fires; ScheduleGone (the append is refused) unless
    it is still due at ``fired.due`` in this conversation and no plan of the batch fired it."""
    row = view.schedules.get(fired.schedule_id)
    if row is None or row[0] != name or row[1] != fired.due or fired.schedule_id in view.fired:
        raise ScheduleGone(name, fired.schedule_id)
    return fired.schedule_id, fired.next_due, fired.next_due is None and row[2] is None


@dataclass(frozen=True, slots=True)
class AppendOp:
    """Append events; the result is their positions, or the stored events if ``with_events``."""

    append: PreparedAppend
    documents: tuple[tuple[int, tuple[tuple[str, str], ...]], ...]  # (index, chunks)
    artifacts: tuple[tuple[int, bytes], ...]  # (index, compressed full content)
    with_events: bool = False
    fence: tuple[int, int] | None = None  # (shard, epoch held) on a clustered node
    audit: ModelCall | None = None  # the model call behind the events: its row too

    @classmethod
    def build(
        cls,
        append: PreparedAppend,
        *,
        with_events: bool = False,
        fence: tuple[int, int] | None = None,
        audit: ModelCall | None = None,
    ) -> AppendOp:
        documents = tuple(
            (i, tuple(document_chunks(e.text))) for i, e in enumerate(append.events) if e.text
        )
        artifacts = tuple(
            (i, compress_artifact(e.artifact_data))
            for i, e in enumerate(append.events)
            if e.artifact_data is not None
        )
        return cls(append, documents, artifacts, with_events, fence, audit)

    @property
    def conversation_id(self) -> str:
        return self.append.conversation_id

    @property
    def idempotency_key(self) -> str | None:
        return self.append.key

    def plan(self, view: View) -> Plan:
        append = self.append
        name = append.conversation_id
        epoch = check_fence(view, name, self.fence)  # first: a fenced node learns nothing more
        state = view.state(name)
        if append.key is not None:
            planned = view.planned_keys.get((name, append.key))
            if planned is not None:
                if planned[3] != append.fingerprint:
                    raise IdempotencyConflict(name, append.key)
                return Plan(self._result(planned[0], planned[2]))
            stored = view.stored_keys.get((name, append.key))
            if stored is not None:
                first, count, mark, first_body = stored
                if not append.repeats(mark, first_body):
                    raise IdempotencyConflict(name, append.key)
                if self.with_events:
                    return Plan(ReplayEvents(name, first, count))
                return Plan(list(range(first, first + count)))
        if append.expect_head is not None and append.expect_head != state.head:
            conflict = ConflictError(name, append.expect_head, state.head)
            if self.audit is None or (name not in view.planned and name not in view.states):
                raise conflict  # (a deleted conversation: nothing to record the call in)
            # The model call behind the answer was made (and paid for): its row is written
            # as record_model_call would write it; only the answer is refused.
            recorded = ModelCallOp(self.audit, self.fence).plan(view)
            return Plan(Failed(conflict), recorded.name, None, recorded.writes)
        events = append.events
        first = state.head + 1
        if first + len(events) > POSITION_LIMIT:
            raise StoreError(f"conversation {name!r} is full (position {first + len(events) - 1})")
        writes = Writes()
        if append.fired is not None:
            writes.schedules.append(_fire(view, name, append.fired))
        size = 0
        indexed: list[tuple[int, int, Body]] | None = None
        for offset, e in enumerate(events):
            size += len(e.body)
            writes.events.append(
                (
                    name, first + offset, e.turn, e.kind, e.tokens, e.created_at, e.body, e.hints,
                    epoch,
                )
            )
            if e.kind in INDEXED_KINDS:
                if indexed is None:
                    indexed = []
                indexed.append((first + offset, e.created_at, e.value))
        for index, chunks in self.documents:
            for chunk, (text, lexemes) in enumerate(chunks):
                writes.fts.append((name, first + index, chunk, text, lexemes))
        for index, data in self.artifacts:
            e = events[index]
            assert e.artifact_id is not None and e.artifact_data is not None
            writes.artifacts.append((e.artifact_id, name, len(e.artifact_data), e.created_at, data))
        if self.audit is not None:
            writes.model_calls.append(_model_call_row(self.audit))
        idempotency = None
        if append.key is not None:
            mark = append.fingerprint
            writes.keys.append((name, append.key, first, len(events), view.now, mark))
            idempotency = ((name, append.key), (first, len(events), events, mark))
        return Plan(
            self._result(first, events),
            name,
            HeadUpdate(first + len(events) - 1, size, None, append.work, append.title),
            writes,
            idempotency,
            indexed,
        )

    def _result(self, first: int, events: tuple[PreparedEvent, ...]) -> list[Any]:
        return self.append.result(first, events, self.with_events)


@dataclass(frozen=True, slots=True)
class CheckpointOp:
    checkpoint: Checkpoint
    fence: tuple[int, int] | None = None

    @property
    def conversation_id(self) -> str:
        return self.checkpoint.conversation_id

    @property
    def idempotency_key(self) -> str | None:
        return None

    def plan(self, view: View) -> Plan:
        cp = self.checkpoint
        check_fence(view, cp.conversation_id, self.fence)
        view.existing(cp.conversation_id, "checkpoint")
        state = view.state(cp.conversation_id)
        check_checkpoint_reach(cp, state.head)
        writes = Writes()
        writes.checkpoints.append(
            (cp.conversation_id, cp.position, cp.created_at, encode_checkpoint(cp))
        )
        return Plan(None, cp.conversation_id, HeadUpdate(state.head, 0, cp.position), writes)


@dataclass(frozen=True, slots=True)
class ArtifactOp:
    conversation_id: str
    artifact_id: str
    size: int
    data: bytes  # compressed
    fence: tuple[int, int] | None = None

    @property
    def idempotency_key(self) -> str | None:
        return None

    def plan(self, view: View) -> Plan:
        check_fence(view, self.conversation_id, self.fence)
        view.existing(self.conversation_id, "artifact")
        writes = Writes()
        writes.artifacts.append(
            (self.artifact_id, self.conversation_id, self.size, view.now, self.data)
        )
        return Plan(self.artifact_id, self.conversation_id, None, writes)


@dataclass(frozen=True, slots=True)
class ModelCallOp:
    call: ModelCall
    fence: tuple[int, int] | None = None

    @property
    def conversation_id(self) -> str:
        return self.call.conversation_id

    @property
    def idempotency_key(self) -> str | None:
        return None

    def plan(self, view: View) -> Plan:
        call = self.call
        check_fence(view, call.conversation_id, self.fence)
        view.existing(call.conversation_id, "model call")
        writes = Writes()
        writes.model_calls.append(_model_call_row(call))
        return Plan(None, call.conversation_id, None, writes)


def _model_call_row(call: ModelCall) -> tuple[str, int, int, int, bytes]:
    """The ``model_calls`` row of ``call``."""
    return (call.conversation_id, call.turn, call.call_index, call.created_at,
            encode_model_call(call))
