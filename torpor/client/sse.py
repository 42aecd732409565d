"""Server-Sent Events parsing, as the WHATWG spec says a browser's ``EventSource`` does.

Fed the body's lines (any of CRLF, LF, CR ends them: httpx splits them), it returns
each event once its blank line arrives; an event cut off by a dropped connection
never completes, so nothing half-received is ever handed on.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SSEParser", "ServerSentEvent"]


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

    __slots__ = ("_data", "_event", "_id", "last_id", "retry_ms")

    def __init__(self, last_id: str | None = None) -> None:
        self.last_id = last_id  # what a reconnect resumes from: set as an event completes
        self._id = last_id  # the id being received (an event cut off never moves last_id)
        self.retry_ms: int | None = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> ServerSentEvent | None:
        """One line, without its end; the event it completes, if any."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: the server's keep-alive ping
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
        self._id = self.last_id

    def _dispatch(self) -> ServerSentEvent | None:
        data, event = self._data, self._event
        self.last_id = self._id
        self._event = ""
        self._data = []
        if not data:
            return None
        return ServerSentEvent(event or "message", "\n".join(data), self.last_id)
