"""One MCP server's session in a runtime: connected lazily, shared, restarted when it dies.

A ``Link`` is the only connection (the only child process, for stdio) a runtime holds to
a server, whatever the number of agents using it. Its session lives in one task, the
link's runner (the SDK's client is entered and left by the same task, as anyio wants);
the runner's owner is the runtime's :class:`~torpor.mcp.hub.MCPHub`, which outlives it
and ends it when the runtime stops. Agents' turns call tools on the session from their
own tasks: a request is a message on the session's streams, answered by the runner's
reader.

When the session ends (the process exits, the connection fails, a call finds it
closed) the runner connects again after a backoff (0.2 s doubling to 30 s, back to 0.2
s once a session has stayed up 5 s). Meanwhile a call answers an error result at once:
a server that is down never holds or fails a turn. The tool list is read on connect and
again on ``notifications/tools/list_changed``; ``version`` counts the lists read, so a
view of the tools rebuilds its specs only when it changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from torpor.mcp.results import render_result
from torpor.mcp.servers import MCPServer, MCPServerStdio

if TYPE_CHECKING:
    from mcp import Client
    from mcp.client import Transport

__all__ = ["BACKOFF_MAX", "BACKOFF_START", "Link"]

BACKOFF_START = 0.2
BACKOFF_MAX = 30.0
_HEALTHY = 5.0  # seconds up after which a death is news, not a crash loop: backoff resets
_LIST_PAGES = 100  # a server that pages forever is cut off here


class _Down(Exception):
    """The link has no session now (why: the message)."""


class Link:
    """The session to one server (see the module's docstring)."""

    def __init__(self, server: MCPServer, log: Any) -> None:
        self.server = server
        self.log = log
        self.tools: tuple[Any, ...] = ()  # mcp_types.Tool, as last listed
        self.version = 0  # tool lists read so far
        self.state = "idle"  # idle, connecting, ready, down, closed
        self.last_error: str | None = None
        self.sessions = 0  # sessions opened (restarts + 1)
        self.retry_at = 0.0  # monotonic time of the next attempt, while down
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # the runner has news: the session was lost, or relist
        self._lost = False
        self._relist = False
        self._attempt = asyncio.Event()  # set when the current connection attempt settles
        self._news = asyncio.Event()  # replaced and set at each change of state or list

    def _changed(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def until(self, predicate: Callable[[Link], bool]) -> None:
        """Wait until ``predicate(link)`` holds (checked at each change of state or list:
        a test, a bench, a health check)."""
        while not predicate(self):
            await self._news.wait()

    # -- lifecycle (the hub's) ----------------------------------------------------
    def start(self) -> None:
        """Connect in the background, once (the first agent that needs the tools)."""
        if self._task is None and self.state != "closed":
            self.state = "connecting"
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"torpor-mcp-{self.server.name}"
            )

    async def aclose(self) -> None:
        self.state = "closed"
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._client = None
        self._attempt.set()  # nobody waits for a link that is gone

    async def _run(self) -> None:
        delay = BACKOFF_START
        while True:
            self.state = "connecting"
            self._attempt.clear()  # the same event: a waiter may hold it since start()
            up: float | None = None
            try:
                up = await self._session()
                error = "the server closed the session"
            except Exception as exc:  # a server that cannot start or dies: retried, reported
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._client = None
            if up is not None and up >= _HEALTHY:
                delay = BACKOFF_START
            self.last_error = error
            self.state = "down"
            self.retry_at = time.monotonic() + delay
            self._attempt.set()
            self._changed()
            self.log.warning("mcp_server_down", server=self.server.name, error=error,
                             retry_in=delay)
            await asyncio.sleep(delay)  # the backoff itself: nothing else to wait for
            delay = min(delay * 2, BACKOFF_MAX)

    async def _session(self) -> float | None:
        """Connect, list the tools, serve until lost; seconds it was up (None: never)."""
        from mcp import Client
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        self._lost = self._relist = False
        self._wake.clear()
        with anyio.CancelScope() as scope:
            # The connect (process start and handshake) has a deadline; the session none.
            scope.deadline = anyio.current_time() + self.server.connect_timeout
            async with AsyncExitStack() as stack:
                transport = await self._transport(stack)
                client = Client(transport, message_handler=self._on_message, cache=None)
                await stack.enter_async_context(client)
                tg = await stack.enter_async_context(anyio.create_task_group())
                if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                    await tg.start(self._listen, client)  # before the list: no change missed
                await self._list(client)
                scope.deadline = math.inf
                self._client = client
                self.sessions += 1
                self.state = "ready"
                self.last_error = None
                self._attempt.set()
                self._changed()
                self.log.info("mcp_server_ready", server=self.server.name,
                              tools=len(self.tools), session=self.sessions)
                began = time.monotonic()
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    if self._lost:
                        tg.cancel_scope.cancel()
                        return time.monotonic() - began
                    if self._relist:
                        self._relist = False
                        await self._list(client)
        raise TimeoutError(f"no session within {self.server.connect_timeout:g} seconds")

    async def _listen(
        self, client: Client, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Since protocol 2026-07-28 a list change comes on a ``subscriptions/listen``
        stream, not as a bare notification (which older servers send: ``_on_message``).
        Started (``task_status``) once the server acknowledged it, or could not."""
        from mcp.shared.exceptions import MCPError

        try:
            async with client.listen(tools_list_changed=True) as changes:
                task_status.started()
                async for _ in changes:
                    self._relist = True
                    self._wake.set()
        except (MCPError, TimeoutError, RuntimeError) as exc:  # no list changes: the
            # tools listed on connect stay
            self.log.info("mcp_listen_unavailable", server=self.server.name, error=repr(exc))
            with contextlib.suppress(RuntimeError):  # not started yet: the session goes on
                task_status.started()

    async def _transport(self, stack: AsyncExitStack) -> Transport:
        server = self.server
        if isinstance(server, MCPServerStdio):
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=server.command, args=list(server.args), env=server.env, cwd=server.cwd
            )
            return _watched(stdio_client(params), self._on_eof)
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        http = await stack.enter_async_context(create_mcp_http_client(headers=server.headers))
        return streamable_http_client(server.url, http_client=http)

    async def _list(self, client: Client) -> None:
        tools: list[Any] = []
        cursor: str | None = None
        for _ in range(_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        self.tools = tuple(tools)
        self.version += 1
        self._changed()

    # -- what the session tells us ----------------------------------------------------
    def _lose(self, client: Client | None = None) -> None:
        if client is not None and client is not self._client:
            return  # a call of a session already replaced
        self._lost = True
        self._wake.set()

    def _on_eof(self) -> None:
        self._lose()

    async def _on_message(self, message: object) -> None:
        if isinstance(message, Exception):  # the transport failed: start again
            self.log.info("mcp_transport_error", server=self.server.name, error=repr(message))
            self._lose()
            return
        method = getattr(message, "method", None) or getattr(
            getattr(message, "root", None), "method", None
        )
        if method == "notifications/tools/list_changed":
            self._relist = True
            self._wake.set()

    # -- calls (the agents') ----------------------------------------------------------
    async def _connected(self) -> Client:
        self.start()
        while True:
            client = self._client
            if client is not None:
                return client
            if self.state in ("down", "closed"):
                wait = max(0.0, self.retry_at - time.monotonic())
                raise _Down(f"MCP server {self.server.name!r} is unavailable "
                            f"({self.last_error or self.state}); retrying in {wait:.1f} s")
            await self._attempt.wait()

    async def wait_listed(self) -> None:
        """Wait for the first tool list, unless the link has failed already (then the
        tools known, maybe none, are what there is)."""
        self.start()
        if self.version == 0 and self.state == "connecting":
            await self._attempt.wait()

    async def call(
        self, tool: str, arguments: dict[str, Any], timeout: float  # noqa: ASYNC109
    ) -> tuple[str, bool]:
        """Call ``tool`` (the server's name for it): (result text, is_error). Only a
        cancel escapes: the SDK then tells the server (``notifications/cancelled``)."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        what = f"tool {tool!r} of MCP server {self.server.name!r}"
        client: Client | None = None
        try:
            with anyio.fail_after(timeout):
                client = await self._connected()
                result = await client.call_tool(tool, arguments)
        except TimeoutError:  # cancelled by our deadline: the SDK sent the cancellation
            return f"{what} timed out after {timeout:g} seconds", True
        except _Down as exc:
            return str(exc), True
        except MCPError as exc:
            if exc.error.code == CONNECTION_CLOSED:
                self._lose(client)
                return f"{what} failed: the connection closed before it answered", True
            return f"{what} failed: MCP error {exc.error.code}: {exc.error.message}", True
        except Exception as exc:  # a transport error, a result that does not parse
            self.log.info("mcp_call_failed", server=self.server.name, tool=tool,
                          error=repr(exc))
            if isinstance(exc, OSError | anyio.BrokenResourceError | anyio.ClosedResourceError):
                self._lose(client)
            return f"{what} failed: {type(exc).__name__}: {exc}", True
        return render_result(result)


@asynccontextmanager
async def _watched(inner: Transport, on_eof: Any) -> AsyncIterator[Any]:
    """``inner``'s streams, with the end of what the server sends reported to ``on_eof``:
    a stdio server that exits closes its stdout, which the SDK's reader takes quietly."""
    from mcp.shared.message import SessionMessage

    async with inner as (read, write):
        send, receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)

        async def pump() -> None:
            try:
                async with send:
                    async for item in read:
                        await send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
            finally:
                on_eof()

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            try:
                yield receive, write
            finally:
                tg.cancel_scope.cancel()
