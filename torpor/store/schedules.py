"""Schedules: what the store keeps so a conversation can be woken later, on both backends.

A schedule is one row of ``schedules`` (its conversation's integer key in
``conversation_id``, like every conversation-keyed table: a delete removes it),
with an index on its due time (epoch ms), so finding what is due reads that index
and never one row per schedule in memory.

Firing is an append: the scheduled :class:`~torpor.events.UserMessage` is logged by
the conversation's actor with :class:`Firing` attached, and the same transaction
checks that the row is still due at that time and moves it (the next due time for a
repeating one; removed otherwise). A firing that finds the row gone or moved
(cancelled, or fired already by another node or before a restart) raises
:class:`~torpor.errors.ScheduleGone` and writes nothing: exactly once.

A keyed schedule (``key=``, idempotent like ``send``) is not deleted once done
(fired, cancelled): its row stays with no due time, so a retry with the same key
finds it (and returns it, done) instead of scheduling it again.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime

import msgspec

from torpor.errors import IdempotencyConflict, InvalidInput
from torpor.store.arguments import check_int
from torpor.text import check_id, check_text

__all__ = [
    "DUE_LIMIT",
    "MAX_SCHEDULE_TEXT",
    "MIN_EVERY",
    "Firing",
    "NewSchedule",
    "Schedule",
    "SchedulePage",
    "check_new",
    "check_schedule_id",
    "due_from",
    "next_due",
    "new_schedule_id",
    "schedule_fingerprint",
]

MIN_EVERY = 1.0
"""Seconds: the shortest interval of a repeating schedule."""

MAX_EVERY = 10 * 366 * 86_400.0
"""Seconds: the longest interval (ten years)."""

MAX_SCHEDULE_TEXT = 16_000
"""Characters of a scheduled message (well below what an append measures on the loop)."""

DUE_LIMIT = 253_402_300_800_000
"""Epoch ms: due times are before the year 10000."""


class Schedule(msgspec.Struct, frozen=True, gc=False):
    """One schedule of a conversation (``Runtime.schedule``).

    ``due``: the next firing, epoch milliseconds; None once it is done (a keyed
    schedule that fired or was cancelled is kept for its key). ``every``: seconds
    between firings of a repeating one (None: fires once). ``fired``: how many
    times it has fired.
    """

    id: str
    conversation_id: str
    due: int | None
    text: str
    every: float | None = None
    key: str | None = None
    created_at: int = 0
    fired: int = 0


class SchedulePage(msgspec.Struct, frozen=True, gc=False):
    """A page of pending schedules (``Runtime.admin.schedules``), by id (creation order);
    ``next``: the ``after`` of the following page (None: the last)."""

    schedules: tuple[Schedule, ...]
    next: str | None = None


class Firing(msgspec.Struct, frozen=True, gc=False):
    """What an append that fires a schedule carries: the row must still be due at
    ``due``; it then moves to ``next_due`` (None: done)."""

    schedule_id: str
    due: int
    next_due: int | None


class NewSchedule(msgspec.Struct, frozen=True, gc=False):
    """A checked request to schedule, as the store writes it."""

    id: str
    conversation_id: str
    due: int
    text: str
    every_ms: int | None
    key: str | None
    fingerprint: bytes | None
    created_at: int


def new_schedule_id(now: int) -> str:
    """Time-sortable (ms, then random): ``sch-`` and 24 hex digits."""
    return f"sch-{now:012x}{os.urandom(6).hex()}"


def check_schedule_id(value: object) -> str:
    return check_id(value, "schedule_id")


def _seconds(value: object, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(what, f"must be seconds (a number), got {type(value).__name__}")
    seconds = float(value)
    if not low <= seconds <= high:  # NaN fails too
        raise InvalidInput(what, f"must be from {low:g} to {high:g} seconds, got {value!r}")
    return seconds


def due_from(at: object, after: object, now: int) -> int:
    """The first due time (epoch ms) of ``at`` (an aware datetime, or epoch seconds) xor
    ``after`` (seconds from ``now``, epoch ms); a time in the past is due at once."""
    if (at is None) == (after is None):
        raise InvalidInput("at", "give exactly one of at= and after=")
    if after is not None:
        return now + round(_seconds(after, "after", 0.0, MAX_EVERY) * 1000)
    if isinstance(at, datetime):
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidInput("at", "must be an aware datetime (with a time zone)")
        due = round(at.timestamp() * 1000)
    else:
        due = round(_seconds(at, "at", 0.0, (DUE_LIMIT - 1) / 1000) * 1000)
    if not 0 <= due < DUE_LIMIT:
        raise InvalidInput("at", f"must be before the year 10000, got {at!r}")
    return due


def schedule_fingerprint(text: str, at: object, after: object, every_ms: int | None) -> bytes:
    """What a retry with the same key must repeat: the request, not the due time it
    computed (``after=`` is relative to each call's clock)."""
    when: object = at.isoformat() if isinstance(at, datetime) else at
    encoded = msgspec.msgpack.encode([text, when, after, every_ms])
    return hashlib.blake2b(encoded, digest_size=16).digest()


def check_new(
    conversation_id: str,
    text: object,
    *,
    at: object,
    after: object,
    every: object,
    key: object,
    now: int,
) -> NewSchedule:
    """A schedule request checked (InvalidInput names what is wrong), before any write."""
    check_id(conversation_id)
    body = check_text(text, "text")
    if not body.strip():
        raise InvalidInput("text", "must not be empty")
    if len(body) > MAX_SCHEDULE_TEXT:
        raise InvalidInput("text", f"must be at most {MAX_SCHEDULE_TEXT} characters")
    every_ms = None
    if every is not None:
        every_ms = round(_seconds(every, "every", MIN_EVERY, MAX_EVERY) * 1000)
    if at is None and after is None and every_ms is not None:
        after = every_ms / 1000  # every= alone: first due one interval from now
    due = due_from(at, after, now)
    checked_key = None if key is None else check_id(key, "key")
    mark = schedule_fingerprint(body, at, after, every_ms) if checked_key is not None else None
    return NewSchedule(
        new_schedule_id(now), conversation_id, due, body, every_ms, checked_key, mark, now
    )


def next_due(due: int, every_ms: int | None, now: int) -> int | None:
    """The due time after a firing at ``now`` of one due at ``due``: None for a one-shot;
    for a repeating one the first ``due + k * every`` after ``now``, so intervals missed
    while nothing ran (downtime) fire once, not once each, and the phase is kept (a
    9:00 digest stays at 9:00)."""
    if every_ms is None:
        return None
    if now < due:
        return due + every_ms
    return due + ((now - due) // every_ms + 1) * every_ms


def replayed(existing: Schedule, fingerprint: bytes | None, stored: bytes | None) -> Schedule:
    """The schedule a keyed request finds stored: itself when it repeats that request,
    else IdempotencyConflict (the same key for another schedule)."""
    if stored is None or fingerprint is None or bytes(stored) != fingerprint:
        raise IdempotencyConflict(existing.conversation_id, existing.key or "")
    return existing


def to_schedule(row: tuple[object, ...]) -> Schedule:
    """A ``schedules`` row as read: (id, conversation, due, text, every ms, key, created_at,
    fired)."""
    sid, name, due, text, every_ms, key, created, fired = row
    return Schedule(
        str(sid), str(name), None if due is None else int(due),  # type: ignore[call-overload]
        str(text), None if every_ms is None else int(every_ms) / 1000,  # type: ignore[call-overload]
        None if key is None else str(key), int(created), int(fired),  # type: ignore[call-overload]
    )


def check_until(value: object, what: str) -> int:
    return check_int(value, what, 0, 1 << 62)
