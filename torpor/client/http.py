"""The client: a torpor server's chat API over httpx, with the runtime's own types and errors."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from torpor.client.follow import Follow
from torpor.client.items import Delta, Item, Other, decode_item, decode_value, ends_turn
from torpor.client.problems import (
    HTTPError,
    Problem,
    ServerUnreachable,
    error_for,
    problem_from,
    retry_after_of,
)
from torpor.client.sse import MAX_EVENT_CHARS, SSEParser
from torpor.client.stream import Connection, Opener, ResumingStream, Settings
from torpor.client.turn import Turn
from torpor.errors import UnknownConversation
from torpor.events import Event

__all__ = ["Client", "HistoryPage"]

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)  # the request never left


@dataclass(frozen=True, slots=True)
class HistoryPage:
    """One page of a conversation's log, newest first; ``before`` asks for the next
    (older) page, None at the start of the conversation."""

    events: list[Event | Other]
    before: int | None


class Client:
    """A torpor server's chat API.

    >>> async with torpor.client.Client("https://chat.example", token=tok) as c:
    ...     turn = await c.send("alice:1", "hello")
    ...     async for item in turn: ...
    ...     answer = await turn.result()

    ``timeout``: seconds to connect, send a request or wait for a plain answer;
    ``idle_timeout``: seconds a stream may stay silent before it counts as dropped
    (the server pings idle streams every 15 s). ``retries``: attempts in a row that
    may fail (a network error, a drop with no event, a 502/503/504) before
    :class:`ServerUnreachable`; between them the client waits ``reconnect_delay``
    seconds (default: the server's ``retry:``, else 1 s), doubled per failure up to
    ``max_reconnect_delay``, and at least a 503's ``Retry-After``. ``max_event_chars``:
    a stream's longest line or event (longer raises :class:`EventTooLong`: not a torpor
    server's). ``transport``: an httpx transport (a test's ``ASGITransport``, a proxy).
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 30.0,
                 idle_timeout: float = 45.0, retries: int = 5,
                 reconnect_delay: float | None = None, max_reconnect_delay: float = 30.0,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 max_event_chars: int = MAX_EVENT_CHARS) -> None:
        sent = {"User-Agent": "torpor-client", **(headers or {})}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(base_url=base_url, headers=sent,
                                       timeout=httpx.Timeout(timeout), transport=transport)
        self._stream_timeout = httpx.Timeout(timeout, read=idle_timeout)
        self.settings = Settings(retries, reconnect_delay, max_reconnect_delay)
        self._max_event = max_event_chars

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- turns ------------------------------------------------------------------------------

    async def send(self, conversation_id: str, text: str, *, key: str | None = None) -> Turn:
        """Send a user message; returns its turn once the server logged the message.

        ``key``: the idempotency key (one is made when not given). A connection that
        fails before the message is confirmed is retried with the same key, which the
        server logs once: the turn is the one the first attempt started. Raises the
        runtime's errors (``Busy``, ``AgentParked``, ``InvalidInput``…) as the server
        reports them, :class:`Unauthorized`/:class:`Forbidden`/:class:`Draining` for
        the HTTP layer's."""
        key = key if key is not None else uuid.uuid4().hex
        turn = await self._start(conversation_id, self._path(conversation_id, "messages"),
                                 {"text": text}, key)
        if turn is None:  # a message always streams its turn: this is no torpor server
            raise HTTPError(Problem(202, "NotAnEventStream", "the message was answered "
                                    "without its turn's stream"))
        return turn

    async def resolve(self, conversation_id: str, call_id: str, result: str, *,
                      is_error: bool = False, key: str | None = None) -> Turn | None:
        """Answer a suspended tool call; the continuation's turn once every call it waited
        for is answered, None while others are still open. Retried like ``send`` (the
        server answers a key once: a retry gets the first answer's outcome)."""
        key = key if key is not None else uuid.uuid4().hex
        return await self._start(conversation_id,
                                 self._path(conversation_id, "calls", call_id),
                                 {"result": result, "is_error": is_error}, key)

    def turn(self, conversation_id: str, number: int, *, after: str | None = None) -> Turn:
        """Follow turn ``number`` after the event id ``after`` (a turn this process did not
        start, or one it started before it restarted); None: from the turn's start (a
        server with turn-scoped streams; an older one starts from now)."""
        stream = ResumingStream(self._turn_opener(conversation_id, number), self.settings,
                                conversation_id, parser=SSEParser(after, limit=self._max_event))
        return Turn(stream, conversation_id, number, None,
                    find_end=partial(self._turn_end, conversation_id))

    def follow(self, conversation_id: str, *, after: str | int | None = None) -> Follow:
        """Every item of the conversation after the event id ``after`` (-1: from its first
        event; None: from now on, that is from ``async with`` or the first iteration),
        live, through dropped connections."""
        start = None if after is None else str(after)
        path = self._path(conversation_id, "stream")

        async def reopen(last_id: str | None) -> httpx.Response:
            nonlocal start
            if last_id is None and start is None:  # "now", fixed once: a drop loses nothing
                start = str(await self._head(conversation_id))
            return await self._open("GET", path, headers={"Last-Event-ID": last_id or start or
                                                          "-1"})

        stream = ResumingStream(reopen, self.settings, conversation_id,
                                parser=SSEParser(limit=self._max_event))
        return Follow(stream, conversation_id)

    async def cancel(self, conversation_id: str) -> bool:
        """Cancel the open turn; whether there was one to cancel."""
        data = await self._request("POST", self._path(conversation_id, "cancel"),
                                   conversation_id, retry_on=_CONNECT_ERRORS)
        return bool(data.get("cancelled")) if isinstance(data, dict) else False

    # -- the log ----------------------------------------------------------------------------

    async def history(self, conversation_id: str, *, before: int | None = None,
                      limit: int = 50) -> HistoryPage:
        """Up to ``limit`` events before position ``before`` (None: the newest), newest
        first. Raises ``UnknownConversation`` for a conversation with no events."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        data = await self._request("GET", self._path(conversation_id, "history"),
                                   conversation_id, params=params)
        events: list[Event | Other] = []
        values = data.get("events") if isinstance(data, dict) else None
        for value in values if isinstance(values, list) else ():
            kind = value.get("kind", "") if isinstance(value, dict) else ""
            item = decode_value(kind, value, None, conversation_id)
            assert not isinstance(item, Delta)  # history holds logged events only
            events.append(item)
        older = data.get("before") if isinstance(data, dict) else None
        return HistoryPage(events, older if isinstance(older, int) else None)

    async def scroll(self, conversation_id: str, *, before: int | None = None,
                     limit: int = 50) -> AsyncIterator[Event | Other]:
        """Every event before ``before``, newest first, a page of ``limit`` at a time."""
        while True:
            page = await self.history(conversation_id, before=before, limit=limit)
            for event in page.events:
                yield event
            if page.before is None or not page.events:
                return
            before = page.before

    # -- plumbing ---------------------------------------------------------------------------

    @staticmethod
    def _path(conversation_id: str, *rest: str) -> str:
        return "/".join(["v1/conversations", *(quote(part, safe="")
                                               for part in (conversation_id, *rest))])

    async def _turn_end(self, conversation_id: str, number: int) -> Event | None:
        """Turn ``number``'s logged end, read back from the head."""
        async for event in self.scroll(conversation_id):
            if isinstance(event, Event) and event.turn <= number:
                return event if ends_turn(event, number) else None
        return None

    async def _head(self, conversation_id: str) -> int:
        try:
            page = await self.history(conversation_id, limit=1)
        except UnknownConversation:
            return -1
        return page.events[0].position if page.events and isinstance(
            page.events[0], Event) else -1

    async def _open(self, method: str, path: str, *, json: Any = None,
                    headers: Mapping[str, str] | None = None,
                    params: Mapping[str, Any] | None = None) -> httpx.Response:
        request = self._http.build_request(
            method, path, json=json, params=params, timeout=self._stream_timeout,
            headers={"Accept": "text/event-stream", **(headers or {})})
        return await self._http.send(request, stream=True)

    def _turn_opener(self, conversation_id: str, number: int) -> Opener:
        path = self._path(conversation_id, "stream")

        async def reopen(last_id: str | None) -> httpx.Response:
            # ?turn=: a server with turn-scoped streams sends this turn alone (and ends
            # the stream with it); one without ignores it, and Turn filters
            return await self._open("GET", path, params={"turn": number},
                                    headers={"Last-Event-ID": last_id} if last_id else {})

        return reopen

    async def _request(self, method: str, path: str, conversation_id: str, *,
                       params: Mapping[str, Any] | None = None,
                       retry_on: tuple[type[Exception], ...] = (httpx.TransportError,)) -> Any:
        """A plain request's JSON answer; retried on ``retry_on`` (reads: any network
        error; a cancel: only one that never reached the server)."""
        failures = 0
        while True:
            try:
                response = await self._http.request(method, path, params=params)
            except retry_on as exc:
                failures += 1
                if self.settings.exhausted(failures):
                    raise ServerUnreachable(f"{method} {path}: {exc!r}") from exc
                await asyncio.sleep(self.settings.delay(failures - 1, None, None))
                continue
            body = _json(response)
            if response.status_code >= 400:
                raise error_for(problem_from(response.status_code, body, response.headers),
                                conversation_id)
            return body

    async def _start(self, conversation_id: str, path: str, body: dict[str, Any],
                     key: str) -> Turn | None:
        """POST ``body`` keyed by ``key`` and read up to the turn's first logged event
        (which says the server took the request, and the turn's number); a connection
        that fails before it is retried with the same key."""
        failures = 0
        while True:
            if failures:
                await asyncio.sleep(self.settings.delay(failures - 1, None, None))
            try:
                response = await self._open("POST", path, json=body,
                                            headers={"Idempotency-Key": key})
            except httpx.TransportError as exc:
                failures = self._failed(failures, path, exc)
                continue
            if response.status_code >= 400:
                await response.aread()
                await response.aclose()
                raise error_for(problem_from(response.status_code, _json(response),
                                             response.headers), conversation_id, key)
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                await response.aread()
                await response.aclose()
                answer = _json(response)
                if response.status_code == 202 and isinstance(answer, dict) \
                        and "resolved" in answer:
                    return None  # resolve's 202: answered, no continuation yet
                # a redirect, a proxy's HTML page: not a torpor answer, and nothing to follow
                raise HTTPError(Problem(
                    response.status_code, "NotAnEventStream",
                    f"expected an event stream, got {response.status_code} "
                    f"{content_type or 'without a content type'}", retry_after_of(
                        response.headers), response.headers.get("x-request-id")))
            connection = Connection(response, SSEParser(limit=self._max_event))
            try:
                pending = await self._first_event(connection, conversation_id, key)
            except httpx.TransportError as exc:
                await connection.aclose()
                failures = self._failed(failures, path, exc)
                continue
            except BaseException:
                await connection.aclose()
                raise
            if pending is None:  # the body ended before the turn began: ask again
                await connection.aclose()
                failures = self._failed(failures, path, None)
                continue
            first = pending[-1]
            assert isinstance(first, Event)
            stream = ResumingStream(self._turn_opener(conversation_id, first.turn),
                                    self.settings, conversation_id, connection=connection)
            return Turn(stream, conversation_id, first.turn, key, pending,
                        find_end=partial(self._turn_end, conversation_id))

    def _failed(self, failures: int, what: str, cause: BaseException | None) -> int:
        failures += 1
        if self.settings.exhausted(failures):
            raise ServerUnreachable(f"POST {what}: no answer after {failures} attempts") \
                from cause
        return failures

    @staticmethod
    async def _first_event(connection: Connection, conversation_id: str,
                           key: str) -> list[Item] | None:
        """The items up to the first logged event (None: the body ended first)."""
        items: list[Item] = []
        while True:
            event = await connection.next()
            if event is None:
                return None
            if event.event == "error":
                data = _json_text(event.data)
                status = data.get("status") if isinstance(data, dict) else None
                raise error_for(problem_from(status if isinstance(status, int) else 500,
                                             data, {}), conversation_id, key)
            item = decode_item(event.event, event.data, event.id, conversation_id)
            items.append(item)
            if isinstance(item, Event):
                return items


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _json_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
