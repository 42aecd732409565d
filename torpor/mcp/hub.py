"""The runtime's MCP sessions: one link per server, whatever the number of agents using it.

The hub owns the links' runner tasks: it outlives them, and the runtime closes it
(ending every session, stopping every stdio server) once its agents have stopped.
Nothing here imports the ``mcp`` SDK: a runtime whose agents use no MCP server never
loads it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torpor.errors import RuntimeClosed

if TYPE_CHECKING:
    from torpor.llm.protocol import ToolSpec
    from torpor.mcp.link import Link
    from torpor.mcp.servers import MCPServer
    from torpor.mcp.view import ToolView

__all__ = ["MCPHub"]


class MCPHub:
    """The links of one runtime, by server (see the module's docstring)."""

    __slots__ = ("_closed", "_links", "log")

    def __init__(self, log: Any) -> None:
        self.log = log
        self._links: dict[Hashable, Link] = {}
        self._closed = False

    def link(self, server: MCPServer) -> Link:
        """The link to ``server`` (made, not connected, the first time it is named)."""
        if self._closed:
            raise RuntimeClosed("the runtime's MCP sessions are closed")
        link = self._links.get(server.key)
        if link is None:
            from torpor.mcp.link import Link  # the SDK is needed from here on only

            link = self._links[server.key] = Link(server, self.log)
        return link

    def view(
        self, servers: Sequence[MCPServer], local: Iterable[str], base: tuple[ToolSpec, ...]
    ) -> ToolView:
        """The tools of one configuration's ``servers`` beside its ``local`` names."""
        from torpor.mcp.view import ToolView

        return ToolView([(s, self.link(s)) for s in servers], local, base)

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(self._links.values())

    async def aclose(self) -> None:
        """End every session (the runtime's exit, after its agents stopped)."""
        self._closed = True
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.aclose()
