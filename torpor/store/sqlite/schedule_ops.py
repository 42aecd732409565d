"""The schedule writes on SQLite, planned against a :class:`~.batch.Batch` like every
write (see :mod:`torpor.store.schedules`): adding one, cancelling one, and the check
and move an append that fires one makes in its own transaction.

A batch plans every operation before it writes any (bulk mode), so what an earlier
operation of the batch changed is kept in ``batch.schedules`` and read before the
database: a second firing of one schedule in one batch finds it moved, a second
keyed add finds the first.
"""

from __future__ import annotations

from typing import Any

import msgspec

from torpor.errors import ScheduleGone, TooManySchedules, UnknownConversation
from torpor.store.schedules import Firing, NewSchedule, Schedule, replayed
from torpor.store.sqlite.batch import Batch, Plan

__all__ = ["AddScheduleOp", "RemoveScheduleOp", "firing_writes"]

_INSERT = (
    "INSERT INTO schedules (id, conversation_id, due, every, text, key, fingerprint, "
    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_BY_KEY = (
    "SELECT id, due, every, text, created_at, fired, fingerprint FROM schedules "
    "WHERE conversation_id = ? AND key = ?"
)
_PENDING = "SELECT count(*) FROM schedules WHERE conversation_id = ? AND due IS NOT NULL"
_ROW = "SELECT conversation_id, due, key FROM schedules WHERE id = ?"
_MOVE = "UPDATE schedules SET due = ?, fired = fired + 1 WHERE id = ?"
_DONE = "UPDATE schedules SET due = NULL WHERE id = ?"
_DELETE = "DELETE FROM schedules WHERE id = ?"

_GONE = object()


def _row(batch: Batch, schedule_id: str) -> tuple[int, int | None, str | None] | None:
    """(conversation key, due, key) of a schedule as this batch sees it; None: no row."""
    planned = batch.schedules.get(("row", schedule_id))
    if planned is _GONE:
        return None
    if planned is not None:
        return planned  # type: ignore[no-any-return]
    found = batch.conn.execute(_ROW, (schedule_id,)).fetchone()
    if found is None:
        return None
    return int(found[0]), None if found[1] is None else int(found[1]), found[2]


def _pending(batch: Batch, key: int) -> int:
    count = batch.schedules.get(("pending", key))
    if count is None:
        count = int(batch.conn.execute(_PENDING, (key,)).fetchone()[0])
    return int(count)


def firing_writes(
    batch: Batch, name: str, key: int, fired: Firing, stored: bool
) -> list[tuple[str, tuple[Any, ...]]]:
    """The writes that move a schedule an append fires; ScheduleGone (the append is
    refused) unless it is still due at ``fired.due`` in this conversation."""
    row = _row(batch, fired.schedule_id) if stored else None
    if row is None or row[0] != key or row[1] != fired.due:
        raise ScheduleGone(name, fired.schedule_id)
    if fired.next_due is not None:
        batch.schedules[("row", fired.schedule_id)] = (key, fired.next_due, row[2])
        return [(_MOVE, (fired.next_due, fired.schedule_id))]
    batch.schedules[("pending", key)] = _pending(batch, key) - 1
    if row[2] is not None:  # keyed: kept, done, for a retry of its key
        batch.schedules[("row", fired.schedule_id)] = (key, None, row[2])
        return [(_MOVE, (None, fired.schedule_id))]
    batch.schedules[("row", fired.schedule_id)] = _GONE
    return [(_DELETE, (fired.schedule_id,))]


class AddScheduleOp(msgspec.Struct, frozen=True, gc=False):
    """Store a new schedule; the result is it, or the one its key stored before."""

    new: NewSchedule
    at_most: int | None = None  # pending schedules the conversation may have, this one in

    @property
    def conversation_id(self) -> str:
        return self.new.conversation_id

    def plan(self, batch: Batch) -> Plan:
        new = self.new
        state = batch.conversation(new.conversation_id)
        if not state.stored:
            raise UnknownConversation(f"conversation {new.conversation_id!r} has no events")
        if new.key is not None:
            found = batch.schedules.get(("key", state.key, new.key))
            if found is None:
                row = batch.conn.execute(_BY_KEY, (state.key, new.key)).fetchone()
                if row is not None:
                    sid, due, every, text, created, fired, mark = row
                    found = (Schedule(
                        sid, new.conversation_id, due, text,
                        None if every is None else every / 1000, new.key, created, fired,
                    ), mark)
            if found is not None:
                return Plan(replayed(found[0], new.fingerprint, found[1]))
        pending = _pending(batch, state.key)
        if self.at_most is not None and pending >= self.at_most:
            raise TooManySchedules(new.conversation_id, self.at_most)
        schedule = Schedule(
            new.id, new.conversation_id, new.due, new.text,
            None if new.every_ms is None else new.every_ms / 1000, new.key, new.created_at,
        )
        batch.schedules[("pending", state.key)] = pending + 1
        batch.schedules[("row", new.id)] = (state.key, new.due, new.key)
        if new.key is not None:
            batch.schedules[("key", state.key, new.key)] = (schedule, new.fingerprint)
        row = (new.id, state.key, new.due, new.every_ms, new.text, new.key, new.fingerprint,
               new.created_at)
        return Plan(schedule, writes=[(_INSERT, row)])


class RemoveScheduleOp(msgspec.Struct, frozen=True, gc=False):
    """Cancel a pending schedule of the conversation; the result: whether it was pending."""

    conversation_id: str
    schedule_id: str

    def plan(self, batch: Batch) -> Plan:
        state = batch.conversation(self.conversation_id)
        row = _row(batch, self.schedule_id) if state.stored else None
        if row is None or row[0] != state.key or row[1] is None:
            return Plan(False)
        batch.schedules[("pending", state.key)] = _pending(batch, state.key) - 1
        if row[2] is not None:
            batch.schedules[("row", self.schedule_id)] = (state.key, None, row[2])
            return Plan(True, writes=[(_DONE, (self.schedule_id,))])
        batch.schedules[("row", self.schedule_id)] = _GONE
        return Plan(True, writes=[(_DELETE, (self.schedule_id,))])
