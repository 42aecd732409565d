"""Tools an agent offers its model: local async functions and externally answered calls.

A tool failure of any kind (unknown name, arguments that do not fit, an
exception, a timeout) becomes an error *result* the model can read and react
to; it never crashes the agent. Cancellation is the one thing that is not a
failure: it always propagates, so cancelling a turn stops its tools.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias, overload

import anyio
import msgspec

from torpor._logging import get_logger
from torpor.actors.json_schema import check_schema, schema_errors
from torpor.actors.tool_context import ToolContext
from torpor.actors.tool_schema import check_tool_name, derive_signature
from torpor.errors import ConfigError, ToolArgumentError
from torpor.events import ToolCall, ToolResult
from torpor.llm.protocol import ToolSpec
from torpor.text import repair_text

__all__ = [
    "ExternalTool",
    "LocalTool",
    "ToolFunction",
    "Toolbox",
    "run_tool",
    "tool",
]

log = get_logger(__name__)

ToolFunction: TypeAlias = Callable[..., Awaitable[Any]]


def _empty_object_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


class LocalTool:
    """An async function the agent runs itself, with the schema derived from its signature.

    Still callable like the function it wraps, so decorating a function does
    not take it away from the code that calls it directly.

    ``context``: the name of the parameter annotated :class:`~torpor.ToolContext`, if the
    function has one (filled in by the runtime on each call, not part of ``spec``).
    """

    __slots__ = (
        "_arguments_type", "_summary", "context", "description", "fn", "name", "spec", "timeout"
    )

    def __init__(
        self,
        fn: ToolFunction,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> None:
        tool_name = check_tool_name(name if name is not None else getattr(fn, "__name__", ""))
        if not inspect.iscoroutinefunction(fn):
            raise ConfigError("tools", f"tool {tool_name!r} must be an async function")
        if timeout is not None and not timeout > 0:
            raise ConfigError("tools", f"tool {tool_name!r}: timeout must be > 0, got {timeout}")
        derived = derive_signature(fn, tool_name, description)
        self.fn = fn
        self.name = tool_name
        self.description = derived.description
        self.timeout = timeout
        self.spec = ToolSpec(tool_name, derived.description, derived.parameters)
        self._arguments_type = derived.arguments_type
        self._summary = derived.summary
        self.context = derived.context

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Convert the model's JSON arguments to the function's types, or raise ToolArgumentError.

        Lenient on purpose (``"3"`` is accepted for an ``int``): models quote
        numbers often enough that refusing them would only cost a round trip.
        """
        try:
            value = msgspec.convert(arguments, self._arguments_type, strict=False)
        except msgspec.ValidationError as exc:
            expected = self._summary or "no arguments"
            raise ToolArgumentError(self.name, f"{exc}; expected ({expected})") from None
        return msgspec.structs.asdict(value)

    @staticmethod
    def render(value: object) -> str:
        """The result text the model reads: a string as is, anything else as JSON."""
        if isinstance(value, str):
            return value
        return msgspec.json.encode(value).decode()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LocalTool(name={self.name!r}, timeout={self.timeout})"


class ExternalTool(msgspec.Struct, frozen=True):
    """A tool whose calls are answered from outside (an approval, a long job).

    The agent does not run it: it logs ``Suspended`` and waits for
    ``resolve(conversation_id, call_id, result)``, across eviction and restarts.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=_empty_object_schema)

    def __post_init__(self) -> None:
        check_tool_name(self.name)
        if not isinstance(self.parameters, dict):
            raise ConfigError("tools", f"tool {self.name!r}: parameters must be a JSON schema dict")
        check_schema(self.parameters, f"tool {self.name!r}: parameters")

    def validate(self, arguments: Mapping[str, Any]) -> None:
        """Raise ToolArgumentError when ``arguments`` break the schema (the model gets it back).

        The schema is used as given: the arguments are not converted, so an
        outside answerer receives exactly what the model sent.
        """
        errors = schema_errors(self.parameters, arguments)
        if errors:
            raise ToolArgumentError(self.name, "; ".join(errors[:5]))

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


AnyTool: TypeAlias = LocalTool | ExternalTool


@overload
def tool(fn: ToolFunction, /) -> LocalTool: ...


@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = None
) -> Callable[[ToolFunction], LocalTool]: ...


def tool(
    fn: ToolFunction | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> LocalTool | Callable[[ToolFunction], LocalTool]:
    """Make an async function a tool: ``@tool``, or ``@tool(name=, description=, timeout=)``.

    The JSON schema comes from the signature (required = no default), the
    description from the docstring's first paragraph, parameter descriptions
    from its ``Args:`` section or ``Annotated[T, msgspec.Meta(description=...)]``.
    """
    if fn is not None:
        return LocalTool(fn, name=name, description=description, timeout=timeout)

    def wrap(f: ToolFunction) -> LocalTool:
        return LocalTool(f, name=name, description=description, timeout=timeout)

    return wrap


def _error(call: ToolCall, tool_name: str, message: str) -> ToolResult:
    return ToolResult(call_id=call.id, tool=tool_name, content=message, is_error=True)


async def run_tool(
    tool: LocalTool,
    call: ToolCall,
    *,
    timeout: float | None,  # noqa: ASYNC109 - a default that the tool's own timeout overrides
    grace: float = 5.0,
    abandon: Callable[[asyncio.Task[Any], str], None] | None = None,
    context: ToolContext | None = None,
) -> ToolResult:
    """Run one call of a local tool and always return its result; only cancellation escapes.

    ``timeout`` is the agent's default; the tool's own timeout wins over it. The
    tool runs in a task of its own, so a tool that ignores cancellation cannot
    hold the turn: past its timeout (or a cancel) it gets ``grace`` seconds to
    stop, then it is handed to ``abandon`` (the runtime owns it from there and
    reports it) and the turn goes on without it.

    ``context``: what the tool's ``ToolContext`` parameter gets (a tool that has one and
    is given none gets an error result: the runtime always gives one).
    """
    limit = tool.timeout if tool.timeout is not None else timeout
    try:
        arguments = tool.validate(call.arguments)
    except ToolArgumentError as exc:
        return _error(call, tool.name, str(exc))
    if tool.context is not None:  # after validate: the model cannot name it (unknown field)
        if context is None:
            return _error(call, tool.name, f"tool {tool.name!r} needs a ToolContext")
        arguments[tool.context] = context
    task = asyncio.get_running_loop().create_task(tool.fn(**arguments))
    what = f"tool {tool.name!r} (call {call.id})"
    try:
        done, _ = await asyncio.wait((task,), timeout=limit)
    except BaseException:  # the turn was cancelled: stop the tool, within the deadline
        await _stop(task, grace, abandon, what)
        raise
    if not done:
        await _stop(task, grace, abandon, what)
        log.info("tool_timed_out", tool=tool.name, call_id=call.id, timeout=limit)
        return _error(call, tool.name, f"tool {tool.name!r} timed out after {limit:g} seconds")
    failure = task.exception()
    if failure is not None:  # a failing tool is news for the model, not a crash
        log.info("tool_failed", tool=tool.name, call_id=call.id, error=repr(failure))
        detail = f": {failure}" if str(failure) else ""
        kind = type(failure).__name__
        return _error(call, tool.name, f"tool {tool.name!r} raised {kind}{detail}")
    try:
        content = tool.render(task.result())
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        message = f"tool {tool.name!r} returned a value JSON cannot hold: {exc}"
        return _error(call, tool.name, message)
    return ToolResult(call_id=call.id, tool=tool.name, content=repair_text(content))


async def _stop(
    task: asyncio.Task[Any],
    grace: float,
    abandon: Callable[[asyncio.Task[Any], str], None] | None,
    what: str,
) -> None:
    """Cancel ``task`` and wait up to ``grace`` seconds; past that it is abandoned."""
    task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.wait((task,), timeout=grace)
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: an error while stopping is not news
        return
    if abandon is not None:
        abandon(task, what)


class Toolbox:
    """The tools one agent offers, by name; built once per configuration, shared by its agents."""

    __slots__ = ("_tools", "specs")

    def __init__(self, tools: Iterable[AnyTool | ToolFunction] = ()) -> None:
        by_name: dict[str, AnyTool] = {}
        for item in tools:
            entry = self._coerce(item)
            if entry.name in by_name:
                raise ConfigError("tools", f"two tools are named {entry.name!r}")
            by_name[entry.name] = entry
        self._tools = by_name
        self.specs: tuple[ToolSpec, ...] = tuple(t.spec for t in by_name.values())

    @staticmethod
    def _coerce(item: AnyTool | ToolFunction) -> AnyTool:
        if isinstance(item, LocalTool | ExternalTool):
            return item
        if callable(item):
            return LocalTool(item)  # a bare async function: wrap it as @tool would
        raise ConfigError("tools", f"{item!r} is not a tool")

    def with_tools(self, extra: Iterable[AnyTool | ToolFunction]) -> Toolbox:
        """This toolbox plus ``extra`` (built-in tools such as recall); collisions still fail."""
        return Toolbox([*self._tools.values(), *extra])

    def get(self, name: str) -> AnyTool | None:
        return self._tools.get(name)

    def is_external(self, name: str) -> bool:
        return isinstance(self._tools.get(name), ExternalTool)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def unknown_tool_result(self, call: ToolCall) -> ToolResult:
        """The error result for a call naming a tool this agent does not have."""
        available = ", ".join(self._tools) if self._tools else "none"
        return _error(call, call.name, f"unknown tool {call.name!r}; available: {available}")

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[AnyTool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"Toolbox({', '.join(self._tools)})"
