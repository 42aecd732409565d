"""ScriptedModel: plays a fixed script so tests can drive tool use, failures and slow streams.

Each ``stream()`` call consumes the next step of the script; a step is a
sequence of actions performed in order. ``Wait`` and ``Signal`` let a test
line itself up with a precise point inside a stream through events, never
through sleeps: the model signals "I got here" and waits for "go on".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import anyio

from torpor.errors import ConfigError, ModelError
from torpor.events import ToolCall
from torpor.llm.protocol import (
    ContextMessage,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)

__all__ = [
    "Action",
    "Call",
    "Fail",
    "Pause",
    "Report",
    "ScriptedModel",
    "Signal",
    "Step",
    "Text",
    "Wait",
]


@dataclass(frozen=True, slots=True)
class Text:
    """Stream this text as one delta."""

    text: str


@dataclass(frozen=True, slots=True)
class Call:
    """Ask for a tool call; without an ``id`` the model numbers it ``call_1``, ``call_2``, …

    ``arguments`` other than a dict (a JSON string, a list) are sent as they are:
    a model of one's own that gets them wrong, as a test needs it.
    """

    name: str
    arguments: dict[str, Any] | Any = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    """Raise ``exception`` at this point of the stream (a model error mid-stream)."""

    exception: BaseException


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep, to simulate a slow provider (latency, never test synchronisation)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Block the stream until a test sets ``event``."""

    event: anyio.Event


@dataclass(frozen=True, slots=True)
class Signal:
    """Set ``event`` when the stream reaches this point, so a test knows where the model is."""

    event: anyio.Event


@dataclass(frozen=True, slots=True)
class Report:
    """Yield a usage report (prompt and completion tokens as a provider would give them)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None


Action: TypeAlias = Text | Call | Fail | Pause | Wait | Signal | Report
Step: TypeAlias = str | Action | Sequence[Action]
"""A step: a sequence of actions; a bare string or a single action is shorthand for one."""

_ACTIONS = (Text, Call, Fail, Pause, Wait, Signal, Report)


def _normalise(step: Step, index: int) -> tuple[Action, ...]:
    if isinstance(step, str):
        return (Text(step),)
    if isinstance(step, _ACTIONS):
        return (step,)
    actions = tuple(step)
    for action in actions:
        if not isinstance(action, _ACTIONS):
            raise ConfigError("steps", f"step {index} holds {action!r}, which is not an action")
    return actions


class ScriptedModel:
    """A model that performs the given steps, one per call, and remembers what it was sent.

    ``calls`` holds the context of every call (copied, in order) and
    ``tool_specs`` the tool schemas of every call, so a test can assert
    exactly what the runtime rendered. Past the last step it raises
    :class:`~torpor.errors.ModelError`, unless ``loop=True`` starts over.
    """

    def __init__(
        self, steps: Sequence[Step], *, name: str = "scripted", loop: bool = False
    ) -> None:
        if isinstance(steps, str):
            raise ConfigError("steps", "expected a sequence of steps, got a single string")
        self.steps: tuple[tuple[Action, ...], ...] = tuple(
            _normalise(step, i) for i, step in enumerate(steps)
        )
        if loop and not self.steps:
            raise ConfigError("steps", "a looping script needs at least one step")
        self.name = name
        self.loop = loop
        self.calls: list[list[ContextMessage]] = []
        self.tool_specs: list[tuple[ToolSpec, ...]] = []
        self._next_step = 0
        self._next_call_number = 1

    @classmethod
    def replies(cls, *texts: str, name: str = "scripted", loop: bool = False) -> ScriptedModel:
        """A model answering each call with the next text, as one delta."""
        return cls([(Text(text),) for text in texts], name=name, loop=loop)

    @property
    def remaining(self) -> int:
        """Steps not played yet (always the whole script's length when looping)."""
        return len(self.steps) if self.loop else len(self.steps) - self._next_step

    def _take_step(self) -> tuple[Action, ...]:
        if self._next_step >= len(self.steps):
            if not self.loop:
                raise ModelError(
                    f"scripted model {self.name!r} was called {len(self.calls)} times but its"
                    f" script has {len(self.steps)} steps (pass loop=True to repeat it)"
                )
            self._next_step = 0
        step = self.steps[self._next_step]
        self._next_step += 1
        return step

    def _call_id(self, given: str | None) -> str:
        if given is not None:
            return given
        number = self._next_call_number
        self._next_call_number += 1
        return f"call_{number}"

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        self.calls.append(list(context))
        self.tool_specs.append(tuple(tools))
        for action in self._take_step():
            if isinstance(action, Text):
                yield TextDelta(action.text)
            elif isinstance(action, Call):
                arguments = action.arguments
                if isinstance(arguments, dict):
                    arguments = dict(arguments)  # a copy: the runtime may keep it
                call = ToolCall(self._call_id(action.id), action.name, arguments)
                yield ToolCallDelta(call)
            elif isinstance(action, Report):
                yield Usage(
                    action.prompt_tokens,
                    action.completion_tokens,
                    action.cache_read_tokens,
                    action.cache_write_tokens,
                )
            elif isinstance(action, Pause):
                await anyio.sleep(action.seconds)
            elif isinstance(action, Wait):
                await action.event.wait()
            elif isinstance(action, Signal):
                action.event.set()
            else:
                raise action.exception

    def __repr__(self) -> str:
        return f"ScriptedModel(name={self.name!r}, steps={len(self.steps)}, loop={self.loop})"
