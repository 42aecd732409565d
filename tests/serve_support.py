"""Serving an app on a real loopback socket inside a test's event loop, and reading it back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette

from torpor.runtime import Runtime
from torpor.serve import Server, app, bearer_token, bind, service_of
from torpor.serve.access import Authorize
from torpor.serve.client import Client, Connection, Response, SSEEvent

TOKEN = "chat-token"
ADMIN = "admin-token"


@asynccontextmanager
async def serving(application: Starlette) -> AsyncIterator[str]:
    """Serve ``application`` on 127.0.0.1 (a free port); yields its base URL."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = Server(uvicorn.Config(application, lifespan="on", log_config=None,
                                   access_log=False, timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        service = getattr(application.state, "torpor", None)
        if service is not None:
            await service.shutdown(0)
        server.should_exit = True
        await task


@asynccontextmanager
async def served(
    rt: Runtime, *, authorize: Authorize | None = None, **kwargs: Any
) -> AsyncIterator[tuple[str, Client, Starlette]]:
    application = app(rt, authorize=authorize or bearer_token(TOKEN), admin_token=ADMIN,
                      **kwargs)
    async with serving(application) as url:
        yield url, Client(url, TOKEN), application


async def events_until(response: Response, stop: Any) -> list[SSEEvent]:
    """Read SSE events until ``stop(event)`` is true (included) or the body ends."""
    out: list[SSEEvent] = []
    async for event in response.events():
        out.append(event)
        if stop(event):
            break
    return out


async def post_message(client: Client, cid: str, text: str,
                       headers: dict[str, str] | None = None) -> tuple[Connection, Response]:
    return await client.open("POST", f"/v1/conversations/{cid}/messages", json_body={"text": text},
                             headers={"Accept": "text/event-stream", **(headers or {})},
                             conn=client.connection())


def kinds(events: list[SSEEvent]) -> list[str]:
    return [e.event for e in events]


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.json()["text"] for e in events if e.event == "delta")


__all__ = ["ADMIN", "TOKEN", "events_until", "kinds", "post_message", "served", "serving",
           "service_of", "text_of"]
