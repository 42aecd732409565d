"""What an agent names to use an MCP server's tools: how to reach it, and which tools to take.

Plain settings, no SDK import: a config can be built (and checked) where the ``mcp``
package is not installed; only connecting needs it. Two configs that reach the same
server (same command, arguments, environment and folder; or same URL and headers) share
one session in a runtime, whatever their names, filters and approval rules: those are
how one agent sees the server, not the server.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from urllib.parse import urlsplit

from torpor.errors import ConfigError

__all__ = ["MCPServer", "MCPServerHTTP", "MCPServerStdio", "NamePredicate", "ToolSelector"]

NamePredicate = Callable[[str], bool]
ToolSelector = NamePredicate | Collection[str] | None
"""Tool names (the server's own), or a predicate on them; None: none (approval), all (filter)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")  # a prefix must leave room in a 64-char tool name
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def _derived_name(word: str) -> str:
    """A server name from a command or host: ``@scope/server-x`` -> ``server-x``."""
    word = word.rstrip("/").rsplit("/", 1)[-1]
    word = re.sub(r"\.(js|mjs|py|exe)$", "", word)
    return _UNSAFE.sub("_", word).strip("_")[:32] or "mcp"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError("mcp_servers", f"server name {name!r} must be 1-32 letters, digits, "
                                         "'_' or '-'")
    return name


def _check_selector(value: object, what: str) -> ToolSelector:
    if value is None or callable(value):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, Collection):
        raise ConfigError("mcp_servers", f"{what} must be tool names or a predicate, "
                                         f"got {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise ConfigError("mcp_servers", f"{what} must name tools by str")
    return frozenset(value)


def selects(selector: ToolSelector, name: str, default: bool) -> bool:
    """Whether ``selector`` takes tool ``name`` (``default`` when it is None)."""
    if selector is None:
        return default
    if callable(selector):
        return bool(selector(name))
    return name in selector


class _Server:
    """What both transports share: the name its tools are prefixed with on a clash,
    which tools the agent takes (``tool_filter``) and which need an approval first
    (``require_approval``, besides those annotated ``destructiveHint: true``)."""

    __slots__ = ("connect_timeout", "name", "require_approval", "tool_filter")

    def __init__(
        self,
        name: str,
        tool_filter: ToolSelector,
        require_approval: ToolSelector,
        connect_timeout: float,
    ) -> None:
        self.name = _check_name(name)
        self.tool_filter = _check_selector(tool_filter, "tool_filter")
        self.require_approval = _check_selector(require_approval, "require_approval")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int | float) \
                or not 0 < connect_timeout <= 3600:
            raise ConfigError("mcp_servers", f"connect_timeout must be seconds in (0, 3600], "
                                             f"got {connect_timeout!r}")
        self.connect_timeout = float(connect_timeout)

    @property
    def key(self) -> Hashable:
        """What identifies the server itself: one session per key per runtime."""
        raise NotImplementedError

    def takes(self, tool: str) -> bool:
        return selects(self.tool_filter, tool, True)

    def gated(self, tool: str) -> bool:
        """Named by ``require_approval`` (annotations are the link's to judge)."""
        return selects(self.require_approval, tool, False)


class MCPServerStdio(_Server):
    """An MCP server run as a child process, spoken to over its stdin and stdout.

    ``env``: variables added to the SDK's safe default environment (PATH, HOME...;
    not the whole of ours: a server gets no secret it was not given). ``name``:
    defaults to the last argument naming a package or a file (``@scope/server-x`` ->
    ``server-x``, ``tools/server.py`` -> ``server``), else the command.
    """

    __slots__ = ("args", "command", "cwd", "env")

    def __init__(
        self,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        name: str | None = None,
        tool_filter: ToolSelector = None,
        require_approval: ToolSelector = None,
        connect_timeout: float = 30.0,
    ) -> None:
        if not isinstance(command, str) or not command:
            raise ConfigError("mcp_servers", "command must be a non-empty str")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ConfigError("mcp_servers", "args must be a list of str")
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError("mcp_servers", "env must map str to str")
        self.command = command
        self.args = tuple(args)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        # A package or a script names the server better than the command (npx, node).
        words = [a for a in self.args if "/" in a or "@" in a or "." in a]
        super().__init__(
            name if name is not None else _derived_name(words[-1] if words else command),
            tool_filter, require_approval, connect_timeout,
        )

    @property
    def key(self) -> Hashable:
        env = tuple(sorted(self.env.items())) if self.env is not None else None
        return ("stdio", self.command, self.args, env, self.cwd)

    def __repr__(self) -> str:
        return f"MCPServerStdio({self.command!r}, {list(self.args)!r}, name={self.name!r})"


class MCPServerHTTP(_Server):
    """An MCP server reached over streamable HTTP at ``url`` (``headers`` on every
    request: a bearer token, say). ``name`` defaults to the URL's host."""

    __slots__ = ("headers", "url")

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        name: str | None = None,
        tool_filter: ToolSelector = None,
        require_approval: ToolSelector = None,
        connect_timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("mcp_servers", f"url must be an http(s) URL, got {url!r}")
        if headers is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ConfigError("mcp_servers", "headers must map str to str")
        self.url = url
        self.headers = dict(headers) if headers is not None else None
        super().__init__(
            name if name is not None else _derived_name(parts.hostname.replace(".", "_")),
            tool_filter, require_approval, connect_timeout,
        )

    @property
    def key(self) -> Hashable:
        headers = tuple(sorted(self.headers.items())) if self.headers is not None else None
        return ("http", self.url, headers)

    def __repr__(self) -> str:  # no headers: they may hold a token
        return f"MCPServerHTTP({self.url!r}, name={self.name!r})"


MCPServer = MCPServerStdio | MCPServerHTTP
