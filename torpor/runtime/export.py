"""A conversation as JSON-able records, for data portability (``Runtime.export``).

The records, in order:

* ``{"type": "conversation", "id", "created_at", "last_activity", "events", "title",
  "metadata"}``: the index row, first;
* ``{"type": "event", "position", "turn", "kind", "created_at", "tokens", "body"}``
  per logged event, oldest first: the shape ``/history`` answers (the body's fields,
  bytes as base64; an abort's caller-facing fields filled in; not a user message's
  ``metadata``, the server's word about the sender for the tools: the log and
  ``torpor history`` show it), up to the head the export began at;
* after an event whose body was clipped (its full text in an artifact), that
  artifact's full text inline: ``{"type": "artifact", "id", "position", "offset",
  "text", "last"}`` records of at most :data:`ARTIFACT_CHUNK` characters each.

Bounded memory: events are read :data:`EXPORT_PAGE` at a time and an artifact is
held alone while its chunks go out; nothing wakes the agent (a read of the store).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from torpor.errors import UnknownConversation
from torpor.events import Aborted, Event, abort_fields_of, kind_of
from torpor.store.clip import artifact_of
from torpor.store.protocol import EventStore

__all__ = ["ARTIFACT_CHUNK", "EXPORT_PAGE", "event_record", "export_records"]

EXPORT_PAGE = 256
"""Events read from the store at a time."""

ARTIFACT_CHUNK = 256 * 1024
"""Characters of an artifact's text per record, at most."""


def event_record(event: Event) -> dict[str, Any]:
    """An event as JSON: where it is, and its body's fields (as ``/history`` shows it)."""
    body = msgspec.to_builtins(event.body)
    if isinstance(body, dict):
        body.pop("type", None)
        body.pop("metadata", None)
        if isinstance(event.body, Aborted):
            body.update(abort_fields_of(event.body)._asdict())
    return {
        "type": "event",
        "position": event.position,
        "turn": event.turn,
        "kind": kind_of(event.body),
        "created_at": event.created_at,
        "tokens": event.tokens,
        "body": body,
    }


async def export_records(store: EventStore, conversation_id: str) -> AsyncIterator[dict[str, Any]]:
    """See the module doc; UnknownConversation for an unknown (or deleted) conversation."""
    info = await store.conversation(conversation_id)
    if info is None or info.head is None:
        raise UnknownConversation(conversation_id)
    yield {
        "type": "conversation",
        "id": info.id,
        "created_at": info.created_at,
        "last_activity": info.last_activity,
        "events": info.events,
        "title": info.title,
        "metadata": info.metadata,
    }
    head = info.head
    start = 0
    while start <= head:
        events = await store.read_range(conversation_id, start, min(head, start + EXPORT_PAGE - 1))
        if not events:  # deleted while it was read
            raise UnknownConversation(conversation_id)
        for event in events:
            yield event_record(event)
            artifact = artifact_of(event.body)
            if artifact is not None:
                async for record in _artifact(store, artifact, event.position):
                    yield record
        start = events[-1].position + 1


async def _artifact(
    store: EventStore, artifact_id: str, position: int
) -> AsyncIterator[dict[str, Any]]:
    text = (await store.get_artifact(artifact_id)).decode("utf-8", "replace")
    offset = 0
    while True:
        piece = text[offset:offset + ARTIFACT_CHUNK]
        last = offset + len(piece) >= len(text)
        yield {"type": "artifact", "id": artifact_id, "position": position, "offset": offset,
               "text": piece, "last": last}
        if last:
            return
        offset += len(piece)

