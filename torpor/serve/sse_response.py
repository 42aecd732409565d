"""Server-Sent Events as a lean ASGI response: no task of its own, pings from one timer.

An open stream is the request's own task and nothing else: no task group, no ping
task, no task (nor coroutine) waiting for the client to leave. That task sleeps on
one future, which its :class:`Source` (a follower's buffer, read without waiting)
completes when it has events, and :class:`Streams` on each tick of the one timer an
app's open streams share. On a tick the stream pings if it sent nothing since the
last one (a comment line, so proxies keep it open) and looks whether the client has
left: uvicorn's ``send`` to a closed connection returns quietly, so ``receive()``
returning ``http.disconnect`` is the only signal, and the stream asks it without
waiting (one step of the coroutine). A client that left is noticed within one ping
interval, and its follower released. Draining stops every stream once it has sent
what its source holds; while it drains, each stream also waits on ``receive()`` (a
server that is shutting down tells the app nothing else), so a client that leaves
then is seen at once and its turn holds the drain up no longer.

The wire format is sse-starlette's, byte for byte: ``id``, ``event``, ``data`` and
``retry`` lines, CRLF line ends, pings as ``: ping - <UTC time>``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Protocol

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

__all__ = ["HEADERS", "PING_SECONDS", "EventStream", "Source", "Streams", "encode_event"]

PING_SECONDS = 15.0  # a comment line this often keeps proxies from closing an idle stream

_CRLF = b"\r\n"
_LINES = re.compile(rb"\r\n|\r|\n")
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
    (b"content-type", b"text/event-stream; charset=utf-8"),
)


def encode_event(data: bytes, *, event: str | None = None, id: str | None = None,
                 retry: int | None = None) -> bytes:
    """One event on the wire: ``id``, ``event``, a ``data`` line per line of ``data``,
    ``retry``, then a blank line (newlines in the id or the name are dropped)."""
    parts: list[bytes] = []
    if id is not None:
        parts += (b"id: ", _LINES.sub(b"", id.encode()), _CRLF)
    if event is not None:
        parts += (b"event: ", _LINES.sub(b"", event.encode()), _CRLF)
    if b"\n" in data or b"\r" in data:
        for line in _LINES.split(data):
            parts += (b"data: ", line, _CRLF)
    else:
        parts += (b"data: ", data, _CRLF)
    if retry is not None:
        parts += (b"retry: ", str(retry).encode(), _CRLF)
    parts.append(_CRLF)
    return b"".join(parts)


class Source(Protocol):
    """Where a stream's events come from: a buffer, read without waiting."""

    async def open(self) -> None:
        """Once, before the first ``take`` (a follower's replay)."""

    def take(self) -> bytes | None:
        """The next encoded event, None if there is none yet; StopAsyncIteration at the end."""

    def wake_on(self, future: asyncio.Future[None] | None) -> None:
        """Complete ``future`` when ``take`` has something again (None: no longer)."""

    def close(self) -> None:
        """End after what is buffered (the server drains), and release what it holds."""


class Streams:
    """An app's open event streams and the one timer that pings the idle ones.

    Every ``interval`` seconds each stream looks whether its client left, and gets a
    ping if it sent no event since the last tick (so an idle stream hears from the
    server at least every two intervals). ``len()`` is how many are open.
    """

    __slots__ = ("_handle", "_open", "_watching", "interval")

    def __init__(self, interval: float = PING_SECONDS) -> None:
        if not interval > 0:
            raise ValueError(f"the ping interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self._open: set[EventStream] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._watching = False

    def __len__(self) -> int:
        return len(self._open)

    def add(self, stream: EventStream) -> None:
        self._open.add(stream)
        if self._watching:
            stream.watch_client()
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def discard(self, stream: EventStream) -> None:
        self._open.discard(stream)
        if not self._open and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def watch_clients(self) -> None:
        """From now on every stream sees at once when its client leaves (draining)."""
        self._watching = True
        for stream in list(self._open):
            stream.watch_client()

    def stop_all(self) -> None:
        """End every open stream once it has sent what its source holds (draining)."""
        for stream in list(self._open):
            stream.stop()

    def _tick(self) -> None:
        frame = f": ping - {datetime.now(UTC)}\r\n\r\n".encode()
        for stream in self._open:
            stream.tick(frame)
        self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)


class EventStream(Response):
    """An ASGI response sending what ``source`` holds, as it comes, as an event stream.

    The source is closed when the response ends however it ends (the stream ended,
    the client left, HEAD, an error), so what it holds is always released. A
    Starlette ``Response`` only by type (what handlers return); none of its state.
    """

    __slots__ = ("_check", "_gone", "_head", "_on_left", "_ping", "_source", "_stopping",
                 "_streams", "_wake", "_watch", "_wrote", "status_code")

    def __init__(self, source: Source, streams: Streams, *, status_code: int = 200,
                 headers: Sequence[tuple[bytes, bytes]] = HEADERS,
                 on_left: Callable[[], None] | None = None) -> None:
        self._source = source
        self._streams = streams
        self.status_code = status_code
        self._head = headers
        self._stopping = False
        self._ping: bytes | None = None  # a ping the timer asked for, not yet sent
        self._wrote = True  # an event (or the headers) went out since the last tick
        self._check = True  # has the client left? (once at the start, then on each tick)
        self._wake: asyncio.Future[None] | None = None
        self._on_left = on_left  # told when the client goes away before the stream ends
        self._watch = False  # wait on receive() too (draining)
        self._gone: asyncio.Task[None] | None = None  # that wait, owned by the stream

    def tick(self, frame: bytes) -> None:
        """The timer's tick: look whether the client left; ping unless an event went out
        since the last tick."""
        self._check = True
        if self._wrote:
            self._wrote = False
        else:
            self._ping = frame
        self._poke()

    def watch_client(self) -> None:
        """Notice at once when the client leaves, not at the next tick (draining)."""
        self._watch = True
        self._poke()

    def stop(self) -> None:
        """End once the source holds nothing more (it still sends what it has)."""
        self._stopping = True
        self._source.close()
        self._poke()

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        source = self._source
        streams = self._streams
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": list(self._head)})
            if scope.get("method") == "HEAD":  # the headers a GET gets; the stream never starts
                await send(_END)
                return
            streams.add(self)
            try:
                await source.open()
                loop = asyncio.get_running_loop()
                while True:
                    if self._check:  # the timer's tick: has the client left?
                        self._check = False
                        if _left(receive):
                            self._client_left()
                            return
                    if self._watch:
                        gone = self._gone
                        if gone is None:
                            gone = self._gone = loop.create_task(_disconnect(receive))
                            gone.add_done_callback(self._gone_done)
                        elif gone.done():
                            self._client_left()
                            return
                    try:
                        while (frame := source.take()) is not None:
                            self._wrote = True
                            await send({"type": "http.response.body", "body": frame,
                                        "more_body": True})
                    except StopAsyncIteration:
                        break
                    if self._stopping:
                        break
                    if self._ping is not None:
                        frame, self._ping = self._ping, None
                        await send({"type": "http.response.body", "body": frame,
                                    "more_body": True})
                        continue
                    wake = self._wake = loop.create_future()
                    source.wake_on(wake)
                    try:
                        await wake
                    finally:
                        self._wake = None
                        source.wake_on(None)
                await send(_END)
            except OSError:  # a server that says the client left when sent to (ASGI 2.4)
                self._client_left()
                return
            finally:
                streams.discard(self)
        finally:
            gone = self._gone
            if gone is not None and not gone.done():
                gone.cancel()  # nothing is lost: the client is there, and sent nothing
            source.close()

    def _gone_done(self, gone: asyncio.Task[None]) -> None:
        if not gone.cancelled():
            gone.exception()  # a server whose receive() failed: taken as the client gone
        self._poke()

    def _client_left(self) -> None:
        on_left, self._on_left = self._on_left, None
        if on_left is not None:
            on_left()


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has gone (``http.disconnect``); reads past unread body."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _left(receive: Receive) -> bool:
    """Whether the client has gone: ``receive()`` stepped once, not awaited. Once it has
    (and the request's body is read) it returns ``http.disconnect`` at once; while the
    client is there it would wait, and is closed where it waits (nothing is lost: it
    had nothing to return)."""
    while True:
        awaitable = receive()
        step = awaitable if isinstance(awaitable, Coroutine) else awaitable.__await__()
        try:
            step.send(None)
        except StopIteration as done:
            if done.value["type"] == "http.disconnect":
                return True
            continue  # a part of the request's body nobody read: ask again
        step.close()
        return False
