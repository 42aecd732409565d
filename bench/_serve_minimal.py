"""The floor for bench/serve.py: the least app that does a chat turn's durable work over HTTP.

Starlette + sse-starlette + aiosqlite, no torpor: ``POST /v1/conversations/{id}/messages``
checks the bearer token, parses ``{"text": …}``, commits the user message, then streams
the same three Server-Sent Events ``torpor serve --model echo`` sends (``user``, one
``delta`` with the echo, ``assistant``), committing the answer before its event. ``GET
…/stream`` follows a conversation (an idle follower waits on a queue), ``GET /healthz``
answers a constant. ``lean=True`` swaps sse-starlette for :class:`LeanSSE`, a bare ASGI
response with no task group (what a leaner SSE response would save). Every row is
committed (WAL, ``synchronous=NORMAL``, as torpor's SQLite store), one aiosqlite
connection. It is served by bench/_serve_launch.py exactly
as ``torpor serve`` is (same socket, same uvicorn settings).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiosqlite
from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = ["LeanSSE", "minimal_app"]

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]


class LeanSSE:
    """Server-Sent Events as a bare ASGI response: no anyio task group, no ping task, no
    exit-signal watcher; one plain task waits for the client to leave (uvicorn's ``send``
    to a closed connection returns quietly, so only ``receive`` tells) and ends the stream.
    Pings would come from one shared timer, not a task per stream."""

    def __init__(self, events: AsyncIterator[ServerSentEvent]) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        current = asyncio.current_task()
        assert current is not None
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            current.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
        finally:
            watcher.cancel()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    position INTEGER PRIMARY KEY, conversation TEXT NOT NULL, turn INTEGER NOT NULL,
    kind TEXT NOT NULL, text TEXT NOT NULL, created_at INTEGER NOT NULL)
"""


def minimal_app(db_path: str, token: str, *, lean: bool = False) -> Starlette:
    state: dict[str, Any] = {}
    followers: dict[str, set[asyncio.Queue[ServerSentEvent]]] = {}
    turns: dict[str, int] = {}
    expected = f"Bearer {token}"

    async def commit(conversation: str, turn: int, kind: str, text: str) -> ServerSentEvent:
        created = int(time.time() * 1000)
        db: aiosqlite.Connection = state["db"]
        cursor = await db.execute(
            "INSERT INTO events (conversation, turn, kind, text, created_at) VALUES (?,?,?,?,?)",
            (conversation, turn, kind, text, created))
        await db.commit()
        position = cursor.lastrowid
        event = ServerSentEvent(
            data=json.dumps({"position": position, "turn": turn, "kind": kind,
                             "created_at": created, "body": {"text": text}}),
            event=kind, id=str(position))
        for queue in followers.get(conversation, ()):
            queue.put_nowait(event)
        return event

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == expected

    async def send(request: Request) -> Response:
        if not authorized(request):
            return Response(status_code=401)
        conversation = request.path_params["conversation_id"]
        body = json.loads(await request.body())
        text = body["text"]
        turn = turns[conversation] = turns.get(conversation, 0) + 1
        user = await commit(conversation, turn, "user", text)
        answer = "echo: " + text
        if "application/json" in request.headers.get("accept", ""):
            await commit(conversation, turn, "assistant", answer)
            return Response(json.dumps({"turn": turn}), status_code=202,
                            media_type="application/json")

        async def events() -> AsyncIterator[ServerSentEvent]:
            yield user
            yield ServerSentEvent(data=json.dumps({"text": answer, "offset": 0}),
                                  event="delta", id=f"{user.id}.{len(answer)}")
            yield await commit(conversation, turn, "assistant", answer)

        return sse(events())

    def sse(events: AsyncIterator[ServerSentEvent]) -> Response:
        if lean:
            return LeanSSE(events)  # type: ignore[return-value]  # an ASGI app will do
        return EventSourceResponse(events, ping=15, headers={"Cache-Control": "no-store"})

    async def stream(request: Request) -> Response:
        if not authorized(request):
            return Response(status_code=401)
        conversation = request.path_params["conversation_id"]
        queue: asyncio.Queue[ServerSentEvent] = asyncio.Queue()
        followers.setdefault(conversation, set()).add(queue)

        async def events() -> AsyncIterator[ServerSentEvent]:
            try:
                while True:
                    yield await queue.get()
            finally:
                followers[conversation].discard(queue)

        return sse(events())

    async def health(request: Request) -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    @asynccontextmanager
    async def lifespan(application: Starlette) -> AsyncIterator[None]:
        db = await aiosqlite.connect(db_path)
        await db.execute("PRAGMA journal_mode = WAL")
        await db.execute("PRAGMA synchronous = NORMAL")
        await db.execute(_SCHEMA)
        await db.commit()
        state["db"] = db
        try:
            yield
        finally:
            await db.close()

    base = "/v1/conversations/{conversation_id:path}"
    return Starlette(routes=[
        Route(base + "/messages", send, methods=["POST"]),
        Route(base + "/stream", stream, methods=["GET"]),
        Route("/healthz", health, methods=["GET"]),
    ], lifespan=lifespan)
