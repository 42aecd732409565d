"""Rows to records. A row is bytes until it decodes; one that does not is a CorruptEvent.

So is a row that is not there: positions are dense (0, 1, 2, … per
conversation), so a read knows which positions it must return and names the
first one missing (``CorruptEvent(conversation, position, "missing")``)
instead of skipping it. The check is one comparison per decoded row, plus one
at the end against the conversation's head.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from torpor._rows import ArrayRows
from torpor.errors import CorruptEvent
from torpor.events import Event, decode_body
from torpor.store.listing import ConversationPage, decode_metadata, encode_cursor
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    ModelCall,
    PendingApproval,
    PendingCall,
)

__all__ = [
    "EVENT_COLUMNS",
    "MISSING",
    "check_count",
    "check_reaches",
    "compress_artifact",
    "decode_checkpoint",
    "decode_model_call",
    "encode_checkpoint",
    "encode_model_call",
    "to_conversation_info",
    "to_events",
    "to_pending_approvals",
]

EVENT_COLUMNS = "position, turn, tokens, created_at, body, hints"
EventRow = tuple[int, int, int, int, bytes, bytes | None]

_checkpoint_encoder = msgspec.msgpack.Encoder()
_checkpoint_decoder = msgspec.msgpack.Decoder(Checkpoint)
_calls = ArrayRows(ModelCall)  # audit rows: arrays, maps before (see torpor._rows)


MISSING = "missing"


def to_events(
    conversation_id: str, rows: Iterable[EventRow], first: int | None = None, step: int = 1
) -> list[Event]:
    """Decode rows ordered by position; with ``first``, they must run ``first``, ``first +
    step``, … without a hole (``step`` -1 for newest-first pages)."""
    events = []
    expected = first
    for position, turn, tokens, created_at, body, hints in rows:
        if position != expected and expected is not None:
            raise CorruptEvent(conversation_id, expected, MISSING)
        events.append(
            Event(
                conversation_id,
                position,
                turn,
                tokens,
                created_at,
                decode_body(body, conversation_id=conversation_id, position=position),
                None if hints is None else bytes(hints),
            )
        )
        expected = position + step
    return events


def check_reaches(conversation_id: str, events: list[Event], start: int, end: int) -> None:
    """Oldest-first ``events`` read from ``start`` must reach ``end`` (the head, or the end of
    the range asked for, whichever is lower): the rows after the last one returned exist."""
    last = events[-1].position if events else start - 1
    if last < end:
        raise CorruptEvent(conversation_id, last + 1, MISSING)


def check_count(conversation_id: str, events: list[Event], top: int, limit: int) -> None:
    """A newest-first page from ``top`` must hold ``limit`` events, or every one down to 0."""
    if len(events) < min(limit, top + 1):
        raise CorruptEvent(conversation_id, top - len(events), MISSING)


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    return _checkpoint_encoder.encode(checkpoint)


def decode_checkpoint(conversation_id: str, position: int, data: bytes) -> Checkpoint:
    try:
        return _checkpoint_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(conversation_id, position, f"checkpoint does not decode: {exc}") from exc


def encode_model_call(call: ModelCall) -> bytes:
    return _calls.encode(call)


def decode_model_call(conversation_id: str, turn: int, data: bytes) -> ModelCall:
    try:
        return _calls.decode(data)
    # TypeError: SQLite keeps a body of any type (TEXT, INTEGER), as decode_body knows.
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise CorruptEvent(
            conversation_id, -1, f"model call of turn {turn} does not decode: {exc}"
        ) from exc


ConversationRow = tuple[str, int, int, int | None, int, int, str | None, str | None]


def to_conversation_info(row: Sequence[Any]) -> ConversationInfo:
    """A row of ``conversations``: id, head, bytes, checkpoint position, created_at,
    updated_at, title, metadata (both backends select them in this order)."""
    external_id, head, size, checkpoint_position, created_at, updated_at, title, meta = row[:8]
    return ConversationInfo(
        conversation_id=external_id,
        head=None if head < 0 else head,
        event_count=head + 1,
        checkpoint_position=checkpoint_position,
        bytes=size,
        created_at=created_at,
        updated_at=updated_at,
        title=title or "",
        metadata=decode_metadata(meta),
    )


def page_of(rows: Sequence[Sequence[Any]], limit: int) -> ConversationPage:
    """A page of conversations from index rows (the info columns, then the key), and the
    cursor after its last one when the page is full (there may be more)."""
    items = tuple(to_conversation_info(row) for row in rows)
    after = None
    if len(rows) >= limit and rows:
        last = rows[-1]
        after = encode_cursor(int(last[5]), int(last[8]))
    return ConversationPage(items, after)


def compress_artifact(data: bytes) -> bytes:
    """zlib; the fastest level for very large data, so one huge result cannot stall a batch."""
    return zlib.compress(data, 6 if len(data) < (1 << 20) else 1)


def to_pending_approvals(rows: Iterable[tuple[str, str, str, int, int]]) -> list[PendingApproval]:
    """Pending-index rows (conversation, call id, tool, since, position), ordered by
    conversation, as one record per conversation."""
    grouped: dict[str, list[PendingCall]] = {}
    for name, call_id, tool, since, position in rows:
        grouped.setdefault(name, []).append(PendingCall(call_id, tool, since, position))
    return [
        PendingApproval(name, tuple(calls), min(call.since for call in calls))
        for name, calls in grouped.items()
    ]
