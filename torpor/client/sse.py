"""Server-Sent Events parsing, as the WHATWG spec says a browser's ``EventSource`` does.

Fed the body's lines (any of CRLF, LF, CR ends them: httpx splits them), it returns
each event once its blank line arrives; an event cut off by a dropped connection
never completes, so nothing half-received is ever handed on.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from torpor.client.problems import EventTooLong

__all__ = ["MAX_EVENT_CHARS", "SSEParser", "ServerSentEvent", "lines"]

# A server's store caps a logged event's body (1 MiB unless its max_event_bytes says
# otherwise) and a delta is at most the message it belongs to: the default is far above
# both (Client(max_event_chars=) for a store set higher). Without a cap a server, or a
# proxy, that never ends a line or an event would grow the client's memory without end.
MAX_EVENT_CHARS = 32 * 1024 * 1024
_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One event: its name (``message`` when the server gave none), data and id.

    ``id`` is the last event id after this event (the spec's: an event without an
    ``id:`` line keeps the previous one)."""

    event: str
    data: str
    id: str | None


class SSEParser:
    """Lines in, events out; also the last ``id:`` and ``retry:`` seen (reconnecting uses
    both)."""

    __slots__ = ("_data", "_event", "_id", "_size", "last_id", "limit", "retry_ms")

    def __init__(self, last_id: str | None = None, *, limit: int = MAX_EVENT_CHARS) -> None:
        self.last_id = last_id  # what a reconnect resumes from: set as an event completes
        self._id = last_id  # the id being received (an event cut off never moves last_id)
        self.retry_ms: int | None = None
        self._event = ""
        self._data: list[str] = []
        self._size = 0  # characters of the event being received
        self.limit = limit

    def feed(self, line: str) -> ServerSentEvent | None:
        """One line, without its end; the event it completes, if any."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: the server's keep-alive ping
        self._size += len(line)
        if self._size > self.limit:
            raise EventTooLong(f"an event of more than {self.limit} characters")
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._id = value
        elif field == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def reset(self) -> None:
        """Forget a partly received event (its connection dropped)."""
        self._event = ""
        self._data = []
        self._size = 0
        self._id = self.last_id

    def _dispatch(self) -> ServerSentEvent | None:
        data, event = self._data, self._event
        self.last_id = self._id
        self._event = ""
        self._data = []
        self._size = 0
        if not data:
            return None
        return ServerSentEvent(event or "message", "\n".join(data), self.last_id)


async def lines(text: AsyncIterator[str], limit: int = MAX_EVENT_CHARS) -> AsyncIterator[str]:
    """The lines of a body's text (any of CRLF, LF, CR ends one, as the spec says), each
    without its end; :class:`EventTooLong` past ``limit`` characters (httpx's own
    ``aiter_lines`` holds a line of any length). A last line without its end is cut off:
    it is not yielded."""
    pending: list[str] = []
    size = 0
    after_cr = False  # the previous chunk ended with CR: a LF starting this one ends nothing
    async for chunk in text:
        if after_cr and chunk.startswith("\n"):
            chunk = chunk[1:]
        after_cr = chunk.endswith("\r")
        if not chunk:
            continue
        pieces = _BREAK.split(chunk)
        for piece in pieces[:-1]:
            if size + len(piece) > limit:
                raise EventTooLong(f"a line of more than {limit} characters")
            pending.append(piece)
            yield "".join(pending)
            pending = []
            size = 0
        rest = pieces[-1]
        if rest:
            size += len(rest)
            if size > limit:
                raise EventTooLong(f"a line of more than {limit} characters")
            pending.append(rest)
