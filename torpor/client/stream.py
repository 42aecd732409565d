"""An event stream that survives dropped connections: it resumes from the last event id.

On a drop (a network error, a read that timed out, or a body that ended before
the stream was done) it reconnects with ``Last-Event-ID`` set to the id of the
last event it completed: the server sends exactly what was missed, then the rest
live. It waits before reconnecting as an ``EventSource`` does: the server's
``retry:`` (or the client's ``reconnect_delay``), doubled (with jitter) for every
attempt in a row that brought no event, capped at ``max_reconnect_delay``, and at
least a 503's ``Retry-After``. After ``retries`` such attempts in a row it gives up
with :class:`~torpor.client.ServerUnreachable`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec

from torpor._logging import get_logger
from torpor.client.problems import ServerUnreachable, error_for, problem_from
from torpor.client.sse import ServerSentEvent, SSEParser, lines

__all__ = ["Connection", "Opener", "ResumingStream", "Settings", "StreamOver"]

log = get_logger("torpor.client")

# Answers after which reconnecting may help: the server restarts, drains or moves.
RETRY_STATUSES = frozenset({502, 503, 504})


class StreamOver(Exception):
    """The server has nothing more for this cursor (204: a turn's stream asked for from
    past the turn's end)."""


class Settings:
    """How a client retries and reconnects (see :class:`torpor.client.Client`)."""

    __slots__ = ("max_reconnect_delay", "reconnect_delay", "retries")

    def __init__(self, retries: int | None, reconnect_delay: float | None,
                 max_reconnect_delay: float) -> None:
        self.retries = retries
        self.reconnect_delay = reconnect_delay
        self.max_reconnect_delay = max_reconnect_delay

    def exhausted(self, failures: int) -> bool:
        """Whether ``failures`` attempts in a row are more than may fail."""
        return self.retries is not None and failures > self.retries

    def delay(self, failures: int, retry_ms: int | None, retry_after: float | None) -> float:
        """Seconds to wait before attempt ``failures + 1`` since the last progress."""
        if self.reconnect_delay is not None:
            base = self.reconnect_delay
        else:
            base = retry_ms / 1000 if retry_ms is not None else 1.0
        delay = min(self.max_reconnect_delay, base * float(1 << min(failures, 32)))
        if failures:  # spread the clients a restart dropped together
            delay *= random.uniform(0.5, 1.0)
        return max(delay, retry_after or 0.0)


class Connection:
    """One open event-stream response, read event by event."""

    __slots__ = ("_lines", "parser", "response")

    def __init__(self, response: httpx.Response, parser: SSEParser) -> None:
        self.response = response
        self.parser = parser
        self._lines: AsyncIterator[str] = lines(response.aiter_text(), parser.limit)

    async def next(self) -> ServerSentEvent | None:
        """The next complete event; None when the body ended."""
        while True:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                return None
            event = self.parser.feed(line)
            if event is not None:
                return event

    async def aclose(self) -> None:
        lines = self._lines
        if hasattr(lines, "aclose"):
            await lines.aclose()
        await self.response.aclose()


Opener = Callable[[str | None], Awaitable[httpx.Response]]
"""Opens the stream again after an event id (None: from where it starts)."""


class ResumingStream:
    """Events from ``connection`` and, once it drops, from ``reopen(last id)``."""

    __slots__ = ("_conn", "_conversation_id", "_failures", "_opened", "_progress", "_reopen",
                 "_retry_after", "_settings", "closed", "parser")

    def __init__(self, reopen: Opener, settings: Settings, conversation_id: str, *,
                 connection: Connection | None = None, parser: SSEParser | None = None) -> None:
        self._reopen = reopen
        self._settings = settings
        self._conversation_id = conversation_id
        self.parser = parser or (connection.parser if connection else SSEParser())
        self._conn = connection
        self._failures = 0  # attempts in a row that brought no event
        self._progress = connection is not None
        self._opened = connection is not None  # a connection was made (or tried) before
        self._retry_after: float | None = None
        self.closed = False

    @property
    def last_id(self) -> str | None:
        return self.parser.last_id

    async def connect(self) -> None:
        """Open the stream now, if it is not open (else the first ``next`` does)."""
        if self._conn is None:
            self._conn = await self._connect()

    async def next(self) -> ServerSentEvent:
        """The next event, reconnecting as needed."""
        while True:
            if self.closed:
                raise RuntimeError("the stream is closed")
            conn = self._conn
            if conn is None:
                conn = self._conn = await self._connect()
            try:
                event = await conn.next()
            except httpx.TransportError as exc:
                await self._dropped(exc)
                continue
            except asyncio.CancelledError:
                # The caller gave up waiting (a timeout): the response was cut mid-read, so
                # the next call reconnects from the last complete event.
                self._conn = None
                self.parser.reset()
                await conn.aclose()
                raise
            if event is None:
                await self._dropped(None)
                continue
            if event.event == "error":
                await self._server_error(event)
                continue
            self._progress = True
            self._failures = 0
            return event

    async def aclose(self) -> None:
        self.closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()

    async def _dropped(self, cause: BaseException | None) -> None:
        conn, self._conn = self._conn, None
        self.parser.reset()
        if conn is not None:
            await conn.aclose()
        if not self._progress:
            self._gave_up_after(cause)
        self._progress = False
        log.debug("stream_dropped", conversation_id=self._conversation_id,
                  last_id=self.last_id, error=repr(cause) if cause else "ended")

    def _gave_up_after(self, cause: BaseException | None) -> None:
        self._failures += 1
        if self._settings.exhausted(self._failures):
            raise ServerUnreachable(
                f"{self._conversation_id}: no event after {self._failures} attempts"
            ) from cause

    async def _connect(self) -> Connection:
        while True:
            if self._opened:  # a reconnect waits; the first connection does not
                delay = self._settings.delay(self._failures, self.parser.retry_ms,
                                             self._retry_after)
                self._retry_after = None
                log.debug("stream_reconnect", conversation_id=self._conversation_id,
                          last_id=self.last_id, delay=delay)
                if delay > 0:
                    await asyncio.sleep(delay)
            self._opened = True
            try:
                response = await self._reopen(self.last_id)
            except httpx.TransportError as exc:
                self._gave_up_after(exc)
                continue
            if response.status_code == 200:
                return Connection(response, self.parser)
            if response.status_code == 204:
                await response.aclose()
                self.closed = True
                raise StreamOver(self.last_id)
            body = await _json_of(response)
            problem = problem_from(response.status_code, body, response.headers)
            error = error_for(problem, self._conversation_id)
            if response.status_code not in RETRY_STATUSES:
                raise error
            self._retry_after = problem.retry_after
            self._gave_up_after(error)

    async def _server_error(self, event: ServerSentEvent) -> None:
        """An ``error`` event: the server could not read the log and ended the stream. A
        store that is down (503) may come back: reconnect; anything else is raised."""
        try:
            body = msgspec.json.decode(event.data)
        except msgspec.DecodeError:
            body = {}
        status = body.get("status") if isinstance(body, dict) else None
        problem = problem_from(status if isinstance(status, int) else 500, body, {})
        error = error_for(problem, self._conversation_id)
        if problem.status not in RETRY_STATUSES:
            await self.aclose()
            raise error
        await self._dropped(error)


async def _json_of(response: httpx.Response) -> object:
    try:
        await response.aread()
        return response.json()
    except (ValueError, httpx.HTTPError):
        return None
    finally:
        await response.aclose()
