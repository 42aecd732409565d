"""A conversation follower as a Server-Sent Events response (see :mod:`torpor.serve.sse`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import msgspec

from torpor._logging import get_logger
from torpor.actors.stream import Follower, StreamItem
from torpor.errors import TorporError
from torpor.events import Event
from torpor.serve.problems import status_for
from torpor.serve.service import Service
from torpor.serve.sse import Cursor, Framer, ends_turn
from torpor.serve.sse_response import PING_SECONDS, EventStream, encode_event

__all__ = ["PING_SECONDS", "RETRY_MS", "FollowerFrames", "follow_response"]

log = get_logger("torpor.serve")

RETRY_MS = 1000  # what EventSource clients wait before reconnecting

_encode = msgspec.json.Encoder().encode


class FollowerFrames:
    """A follower's items as encoded events, taken without waiting (an EventStream
    source; an idle stream holds no coroutine of its own: the follower completes the
    stream's future). A subclass says how an item is framed (``_encode``, which may end
    the stream by setting ``_ended``) and which frames end it when the log cannot be read
    (``_error``)."""

    __slots__ = ("_ended", "_follower", "_queued")

    def __init__(self, follower: Follower, *first: bytes) -> None:
        self._follower = follower
        self._queued: deque[bytes] = deque(first)  # frames not yet taken
        self._ended = False

    async def open(self) -> None:
        try:
            await self._follower.replayed()
        except TorporError as exc:
            self._failed(exc)

    def take(self) -> bytes | None:
        queued = self._queued
        while not queued:
            if self._ended:
                raise StopAsyncIteration
            try:
                item = self._follower.take()
            except TorporError as exc:
                self._failed(exc)
                continue
            if item is None:
                return None
            queued.extend(self._encode(item))
        return queued.popleft()

    def wake_on(self, future: asyncio.Future[None] | None) -> None:
        self._follower.wake_on(future)

    def close(self) -> None:
        self._follower.close()

    def _encode(self, item: StreamItem) -> list[bytes]:
        raise NotImplementedError

    def _error(self, exc: TorporError, status: int, title: str) -> list[bytes]:
        raise NotImplementedError

    def _failed(self, exc: TorporError) -> None:
        """The log could not be read (store down, corrupt row): an error ends the stream."""
        log.warning("stream_error", error=repr(exc))
        self._queued.extend(self._error(exc, *status_for(exc)))
        self._ended = True


class _Frames(FollowerFrames):
    __slots__ = ("_framer", "_retry", "_until_turn")

    def __init__(self, follower: Follower, cursor: Cursor, until_turn: int | None) -> None:
        super().__init__(follower)
        self._framer = Framer(cursor, until_turn)
        self._until_turn = until_turn
        self._retry: int | None = RETRY_MS  # on the first event only

    def _encode(self, item: StreamItem) -> list[bytes]:
        frames = []
        for frame in self._framer.frames(item):
            frames.append(encode_event(_encode(frame.data), event=frame.event, id=frame.id,
                                       retry=self._retry))
            self._retry = None
        until = self._until_turn
        if until is not None and isinstance(item, Event) and ends_turn(item, until):
            self._ended = True  # the turn's stream ends with this event
        return frames

    def _error(self, exc: TorporError, status: int, title: str) -> list[bytes]:
        return [encode_event(_encode({"status": status, "title": title,
                                      "error": type(exc).__name__, "detail": str(exc)}),
                             event="error")]


def follow_response(
    service: Service, follower: Follower, cursor: Cursor, *, until_turn: int | None = None,
    status_code: int = 200, on_left: Callable[[], None] | None = None,
) -> EventStream:
    """Stream what ``follower`` yields after ``cursor``. ``until_turn``: only that turn's
    events and text, ending where the turn ends (its answer, suspension or abort); None:
    every turn, until the client leaves or the server stops (draining closes the
    follower, which ends the stream once it has sent what the log says). ``on_left`` is
    called if the client goes away first."""
    return EventStream(_Frames(follower, cursor, until_turn), service.streams,
                       status_code=status_code, on_left=on_left)
