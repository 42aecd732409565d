"""What a stream carries, typed: text deltas, torpor's own logged events, and the rest.

A logged event arrives as JSON (``position``, ``turn``, ``kind``, ``created_at``,
``tokens``, ``body``, see :func:`torpor.serve.sse.event_data`) and is decoded into
the :class:`torpor.events.Event` the server logged, its body one of
:mod:`torpor.events`' structs. An event name this client does not know (a newer
server's) arrives as :class:`Other`, never dropped.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from torpor.errors import TurnAborted
from torpor.events import (
    Aborted,
    Body,
    Event,
    abort_fields_of,
    ends_turn,
)

__all__ = ["Delta", "Item", "Other", "decode_item", "decode_value", "ends_turn", "turn_aborted"]


class Delta(msgspec.Struct, frozen=True, gc=False):
    """A piece of the answer being written.

    ``offset``: where ``text`` starts in the message, in code points (Python's
    ``len``); ``offset16`` the same in UTF-16 code units, and ``turn`` the turn it
    belongs to, when the server sends them. ``id``: the event id to resume after it
    (opaque: pass it back as ``after=``)."""

    text: str
    offset: int = 0
    turn: int | None = None
    offset16: int | None = None
    id: str | None = None


class Other(msgspec.Struct, frozen=True, gc=False):
    """An event this client has no type for (``event`` is its SSE name)."""

    event: str
    data: Any
    id: str | None = None


Item: TypeAlias = Delta | Event | Other

_json = msgspec.json.Decoder()


def decode_item(event: str, data: str, id: str | None, conversation_id: str) -> Item:
    """One SSE event of a conversation's stream, typed."""
    try:
        value = _json.decode(data)
    except msgspec.DecodeError:
        return Other(event, data, id)
    return decode_value(event, value, id, conversation_id)


def decode_value(event: str, value: Any, id: str | None, conversation_id: str) -> Item:
    """An event's decoded JSON, typed (``…/history`` pages hold the same objects)."""
    if not isinstance(value, dict):
        return Other(event, value, id)
    try:
        if event == "delta":
            return msgspec.convert({**value, "id": id}, Delta)
        if value.get("kind") == event and isinstance(value.get("body"), dict):
            body = msgspec.convert({**value["body"], "type": event}, Body)
            return Event(conversation_id, int(value["position"]), int(value["turn"]),
                         int(value.get("tokens") or 0), int(value.get("created_at") or 0), body)
    except (msgspec.ValidationError, KeyError, TypeError, ValueError):
        pass
    return Other(event, value, id)


def turn_aborted(body: Aborted) -> TurnAborted:
    """The runtime's own :class:`~torpor.TurnAborted` for an ``aborted`` event, with the
    structured fields the server sent (``error`` is the name, as ``error_type``)."""
    return TurnAborted(body.reason, body.partial_text, body.detail,
                       fields=abort_fields_of(body))
