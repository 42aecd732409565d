"""The MCP tools one agent configuration offers: names, specs, and which need approval.

Built once per configuration (with its Profile) over the runtime's shared links. A
server's tool list changes (a reconnect, ``notifications/tools/list_changed``), so the
model-facing specs are computed per model call from the links, and rebuilt only when
a link's ``version`` moved: a call with nothing changed costs a tuple comparison.

Names: a server tool keeps its own name (made provider-safe: other characters become
``_``) unless that name clashes with a local or built-in tool or with another server's
tool in this configuration; then every tool of that name is ``<server name>__<tool>``
(both sides of a clash: no winner by order). ``tool_filter`` is applied first, so a
filtered-out tool causes no clash.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torpor._logging import get_logger
from torpor.actors.json_schema import schema_errors
from torpor.errors import ConfigError
from torpor.llm.protocol import ToolSpec
from torpor.mcp.servers import MCPServer

if TYPE_CHECKING:
    from torpor.mcp.link import Link

__all__ = ["MCPTool", "ToolView"]

log = get_logger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SEPARATOR = "__"


class MCPTool:
    """One server tool as this configuration offers it."""

    __slots__ = ("gated", "link", "remote", "spec")

    def __init__(self, link: Link, remote: str, spec: ToolSpec, gated: bool) -> None:
        self.link = link
        self.remote = remote  # the server's own name for it
        self.spec = spec
        self.gated = gated  # needs an approval (resolve) before it runs

    @property
    def name(self) -> str:
        return self.spec.name

    def argument_errors(self, arguments: Any) -> list[str]:
        """What is wrong with ``arguments`` by the tool's schema (one the checker cannot
        read is the server's to judge: no errors here)."""
        try:
            return schema_errors(self.spec.parameters, arguments)
        except ConfigError:
            return []


def _destructive(tool: Any) -> bool:
    """Annotated ``destructiveHint: true`` (and not read-only). The spec's default for an
    absent hint is true, but an unannotated tool is not asked about: only an explicit
    hint gates a call, so a server without annotations does not stall every turn."""
    notes = getattr(tool, "annotations", None)
    return notes is not None and notes.destructive_hint is True and not notes.read_only_hint


class ToolView:
    """The MCP tools of one configuration (see the module's docstring)."""

    __slots__ = ("_base", "_by_name", "_links", "_local", "_versions", "specs")

    def __init__(
        self,
        servers: Sequence[tuple[MCPServer, Link]],
        local: Iterable[str],
        base: tuple[ToolSpec, ...],
    ) -> None:
        self._links = tuple(servers)
        self._local = frozenset(local)  # local and built-in names: never renamed, never lost
        self._base = base
        self._versions: tuple[int, ...] | None = None
        self._by_name: dict[str, MCPTool] = {}
        self.specs = base

    async def current_specs(self) -> tuple[ToolSpec, ...]:
        """The specs for the next model call (the first one waits for each server's first
        tool list, within its connect timeout)."""
        for _, link in self._links:
            if link.version == 0:
                await link.wait_listed()
        self._refresh()
        return self.specs

    def _refresh(self) -> None:
        versions = tuple(link.version for _, link in self._links)
        if versions == self._versions:
            return
        self._versions = versions
        taken: list[tuple[MCPServer, Link, Any, str]] = []
        for server, link in self._links:
            for tool in link.tools:
                if server.takes(tool.name):
                    taken.append((server, link, tool, _UNSAFE.sub("_", tool.name)[:64]))
        counts = Counter(safe for *_, safe in taken)
        by_name: dict[str, MCPTool] = {}
        for server, link, tool, safe in taken:
            name = safe
            if counts[safe] > 1 or safe in self._local:
                name = f"{server.name}{_SEPARATOR}{safe}"[:64]
            if not name or name in by_name or name in self._local:
                log.warning("mcp_tool_skipped", server=server.name, tool=tool.name,
                            reason=f"its name {name!r} is taken")
                continue
            schema = tool.input_schema if isinstance(tool.input_schema, dict) else {}
            spec = ToolSpec(name, tool.description or tool.title or "", dict(schema))
            gated = server.gated(tool.name) or _destructive(tool)
            by_name[name] = MCPTool(link, tool.name, spec, gated)
        self._by_name = by_name
        self.specs = self._base + tuple(t.spec for t in by_name.values())

    def get(self, name: str) -> MCPTool | None:
        """The tool the model calls ``name``, by the specs it was last given."""
        self._refresh()
        return self._by_name.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)
