"""A conversation follower as a Server-Sent Events response (see :mod:`torpor.serve.sse`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse

from torpor._logging import get_logger
from torpor.actors.stream import Follower
from torpor.errors import TorporError
from torpor.events import Event
from torpor.serve.problems import status_for
from torpor.serve.service import Service
from torpor.serve.sse import Cursor, Framer, ends_turn

__all__ = ["PING_SECONDS", "RETRY_MS", "follow_response"]

log = get_logger("torpor.serve")

PING_SECONDS = 15.0  # a comment line keeps proxies from closing an idle stream
RETRY_MS = 1000  # what EventSource clients wait before reconnecting

_encode = msgspec.json.Encoder().encode


async def _frames(
    service: Service, follower: Follower, cursor: Cursor, until_turn: int | None
) -> AsyncIterator[ServerSentEvent]:
    framer = Framer(cursor)
    service.opened(follower)
    first = True
    try:
        async for item in follower:
            for frame in framer.frames(item):
                yield ServerSentEvent(
                    data=_encode(frame.data).decode(), event=frame.event, id=frame.id,
                    retry=RETRY_MS if first else None,
                )
                first = False
            if until_turn is not None and isinstance(item, Event) and ends_turn(item, until_turn):
                return
    except TorporError as exc:  # the log could not be read (store down, corrupt row)
        status, title = status_for(exc)
        log.warning("stream_error", error=repr(exc))
        yield ServerSentEvent(
            data=_encode({"status": status, "title": title, "error": type(exc).__name__,
                          "detail": str(exc)}).decode(),
            event="error",
        )
    finally:
        follower.close()
        service.closed(follower)


def follow_response(
    service: Service, follower: Follower, cursor: Cursor, *, until_turn: int | None = None,
    status_code: int = 200,
) -> EventSourceResponse:
    """Stream what ``follower`` yields after ``cursor``; end after turn ``until_turn`` ends
    (None: follow until the client leaves or the server stops)."""
    return EventSourceResponse(
        _frames(service, follower, cursor, until_turn),
        status_code=status_code,
        ping=PING_SECONDS,
        headers={"Cache-Control": "no-store"},
        client_close_handler_callable=None,
    )
