"""An MCP server of the SDK's own (``MCPServer``, formerly FastMCP) with the tools the MCP
tests need: one that never answers, one that kills its process, 1 MB of text, an error,
a destructive one, one that adds a tool and says so (``tools/list_changed``).

Served in the test's process over streamable HTTP (:func:`make_server`, the test awaits
its events directly), or run as a stdio child: ``python tests/mcp_servers.py``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

BIG = 1_000_000


class Probe:
    """What the in-process server saw: calls started, cancelled, and performed."""

    def __init__(self) -> None:
        self.hang_started = asyncio.Event()
        self.hang_cancelled = asyncio.Event()
        self.wiped = 0


def make_server(probe: Probe | None = None) -> MCPServer:
    probe = probe if probe is not None else Probe()
    server = MCPServer("torpor-test")

    @server.tool()
    async def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @server.tool()
    async def hang() -> str:
        """Never answers (until cancelled)."""
        probe.hang_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            probe.hang_cancelled.set()
            raise
        return "unreachable"

    @server.tool()
    async def big() -> str:
        """One megabyte of text."""
        return "x" * (BIG - 3) + "END"

    @server.tool()
    async def fail() -> str:
        """Always fails."""
        raise ToolError("the tool failed on purpose")  # its message reaches the client

    @server.tool()
    async def die() -> str:
        """Kills the server's own process mid-call."""
        os._exit(3)

    @server.tool()
    async def pid() -> str:
        """The server's process id."""
        return str(os.getpid())

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    async def wipe(target: str) -> str:
        """Deletes ``target`` (destructive: needs an approval)."""
        probe.wiped += 1
        return f"wiped {target} (call {probe.wiped})"

    @server.tool()
    async def grow(ctx: Context) -> str:
        """Adds the tool ``extra`` and tells the client."""

        async def extra() -> str:
            """Added at run time."""
            return "extra here"

        server.add_tool(extra, name="extra")
        await ctx.notify_tools_changed()  # to subscriptions/listen (protocol 2026-07-28)
        return "grown"

    return server


if __name__ == "__main__":
    make_server().run("stdio")
    sys.exit(0)
