"""Server-Sent Events over a conversation's log: event ids that resume exactly.

A logged event's id is its position. Text deltas have no position, so every
id is a *cursor*: ``"P"`` or ``"P.K"``, the last position the client got plus
``K``, the characters of the message in flight (the *draft*) it got since the
last event that ended a draft. Only an assistant message or an abort ends a
draft (they carry its text); any other event logged meanwhile (a user message
sent while the answer streams) leaves the draft going, and its id says how
much of the draft the client already holds. Clients treat ids as opaque.

Resuming from ``P.K`` (``Last-Event-ID``) follows the conversation after
``P`` (``Runtime.subscribe(after=P)``): the log replays what was logged after
``P``, then the text in flight arrives whole and its first ``K`` characters
are dropped. If the draft was logged meanwhile, the rest of its text (past
``K``) is sent as one delta just before the logged message, so the deltas a
client received for a message always add up to exactly its logged text: no
character twice, none missing.

A delta says its ``turn`` and where its text starts in the draft, in code points
(``offset``) and in UTF-16 code units (``offset16``, what a JavaScript string's
``length`` counts). One turn's stream (a POST's, ``?turn=N``) leaves the other
turns' items out but still counts them into its cursor, so its ids resume any
stream of the conversation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from torpor.actors.stream import StreamItem, delta_turn
from torpor.errors import InvalidInput
from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    abort_fields_of,
    ends_turn,
    kind_of,
)
from torpor.llm.protocol import TextDelta
from torpor.store.arguments import POSITION_LIMIT

__all__ = ["Cursor", "Frame", "Framer", "ends_turn", "event_data", "format_cursor",
           "parse_cursor", "utf16_length"]

_CURSOR = re.compile(r"(-1|0|[1-9][0-9]{0,18})(?:\.(0|[1-9][0-9]{0,18}))?")
_MAX_OFFSET = 2**62


@dataclass(frozen=True, slots=True)
class Cursor:
    position: int  # the last logged position the client got (-1: none)
    offset: int = 0  # characters of the draft in flight it got after that


@dataclass(frozen=True, slots=True)
class Frame:
    """One SSE event: its ``event:`` name, its JSON ``data:`` and its ``id:``."""

    event: str
    data: dict[str, Any]
    id: str


def parse_cursor(text: str, what: str = "Last-Event-ID") -> Cursor:
    match = _CURSOR.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(what, f"must be a position or POSITION.OFFSET, got {text[:40]!r}")
    position = int(match.group(1))
    offset = int(match.group(2) or 0)
    # Positions are below POSITION_LIMIT on every backend: a cursor past it is refused here,
    # before the response starts, not by the store once the stream has begun.
    if position >= POSITION_LIMIT or offset > _MAX_OFFSET:
        raise InvalidInput(what, f"out of range (positions are below {POSITION_LIMIT})")
    return Cursor(position, offset)


def format_cursor(position: int, offset: int) -> str:
    return str(position) if offset == 0 else f"{position}.{offset}"


def event_data(event: Event) -> dict[str, Any]:
    """An event as JSON: where it is, and its body's fields (bytes as base64).

    Not a user message's ``metadata``: it is what the server established about the
    sender (ids, roles) for the tools, not for everyone who may read the conversation;
    the log, ``torpor inspect`` and ``torpor history`` show it.
    """
    body = msgspec.to_builtins(event.body)
    if isinstance(body, dict):
        body.pop("type", None)
        body.pop("metadata", None)
        if isinstance(event.body, Aborted):
            # Every field a UI decides on, present even where the row omits it (a default,
            # or a row older than the fields): it need not know which it got.
            body.update(abort_fields_of(event.body)._asdict())
    return {
        "position": event.position,
        "turn": event.turn,
        "kind": kind_of(event.body),
        "created_at": event.created_at,
        "tokens": event.tokens,
        "body": body,
    }


def utf16_length(text: str) -> int:
    """How many UTF-16 code units ``text`` is: what JavaScript's ``String.length`` says
    (an astral character, such as most emoji, is two)."""
    if text.isascii():
        return len(text)
    # surrogatepass: a lone surrogate (never in logged text, which is repaired) counts one
    return len(text.encode("utf-16-le", "surrogatepass")) >> 1


class Framer:
    """Turns a follower's items into frames whose ids resume exactly (see the module doc).

    ``turn``: send only that turn's events and text (a turn's own stream). The other
    turns' items still move the cursor, so an id means the same in every stream of the
    conversation: a turn's stream can be resumed by ``GET …/stream`` with or without
    ``?turn=``.
    """

    __slots__ = ("offset", "offset16", "position", "skip", "turn")

    def __init__(self, cursor: Cursor, turn: int | None = None) -> None:
        self.position = cursor.position
        self.offset = 0  # characters of the current draft sent (or skipped: the client has them)
        self.offset16 = 0  # the same in UTF-16 code units
        self.skip = cursor.offset  # characters of the draft the client has and we have not seen
        self.turn = turn

    @property
    def cursor(self) -> str:
        return format_cursor(self.position, self.offset)

    def _wanted(self, turn: int | None) -> bool:
        return self.turn is None or turn is None or turn == self.turn

    def frames(self, item: StreamItem) -> Iterator[Frame]:
        if isinstance(item, TextDelta):
            text = item.text
            if self.skip:
                dropped = min(self.skip, len(text))
                self.offset16 += utf16_length(text[:dropped])
                text = text[dropped:]
                self.skip -= dropped
                self.offset += dropped
            if text:
                start, start16 = self.offset, self.offset16
                self.offset += len(text)
                self.offset16 += utf16_length(text)
                turn = delta_turn(item)
                if self._wanted(turn):
                    yield Frame("delta", {"text": text, "offset": start, "offset16": start16,
                                          "turn": turn}, self.cursor)
            return
        body = item.body
        wanted = self._wanted(item.turn)
        if isinstance(body, AssistantMessage | Aborted):
            full = body.text if isinstance(body, AssistantMessage) else body.partial_text
            seen = self.offset + self.skip
            if seen and body.artifact is None and len(full) > seen:
                # The client holds the start of this message: send it the rest first.
                self.offset = len(full)
                if wanted:
                    yield Frame("delta", {"text": full[seen:], "offset": seen,
                                          "offset16": utf16_length(full[:seen]),
                                          "turn": item.turn}, self.cursor)
            self.offset = 0
            self.offset16 = 0
            self.skip = 0
        self.position = item.position
        if wanted:
            yield Frame(kind_of(body), event_data(item), self.cursor)
