"""Hooks for what watches turns from outside the actor: metrics, traces, an embedder's own.

An :class:`Observer` is told when a turn runs, when each model call, tool call
and fold of it starts and ends, and when a turn is aborted. Metrics
(:mod:`torpor.serve.metrics`) and OpenTelemetry spans (:mod:`torpor.otel`) are
observers; ``Runtime.observe(observer)`` adds one. The hooks are context
managers entered for the span of the work, in the task that does it, so an
observer that keeps a current span in a context variable (OpenTelemetry) nests
a tool's own spans under its tool call and a model call under its turn.

With no observer the turn loop enters one shared do-nothing context per hook:
no allocation and no call into anything that is not there.

``origin()`` is asked in the caller's context when a message is sent or a call
resolved (an HTTP request's trace, say); what it returns is handed back to
``turn()`` when that turn runs, which may be later (a postponed message) and in
the agent's own task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from torpor.events import AssistantMessage, ToolResult
    from torpor.llm.protocol import Usage

__all__ = [
    "UNOBSERVED",
    "UNWATCHED",
    "AbortInfo",
    "FoldInfo",
    "ModelCallInfo",
    "ModelCallWatch",
    "Observer",
    "Observers",
    "ToolCallInfo",
    "TurnInfo",
]


class TurnInfo(msgspec.Struct, frozen=True, gc=False):
    """A turn (or its part after a suspension was answered: ``continuation``) starting."""

    conversation_id: str
    turn: int
    continuation: bool = False
    postponed: bool = False


class ModelCallInfo(msgspec.Struct, frozen=True, gc=False):
    """One model call of a turn: ``call_index`` counts the turn's calls from 1; ``model``
    is the model's name as the audit records it."""

    conversation_id: str
    turn: int
    call_index: int
    model: str
    estimated_tokens: int
    tools: int = 0
    # What the model object says of itself, where it does (an adapter's ``provider`` and
    # ``model``): the GenAI span conventions name the provider and the model requested.
    provider: str | None = None
    request_model: str | None = None


class ToolCallInfo(msgspec.Struct, frozen=True, gc=False):
    """One local tool call (built-in tools included; external ones suspend instead)."""

    conversation_id: str
    turn: int
    call_id: str
    tool: str


class FoldInfo(msgspec.Struct, frozen=True, gc=False):
    """A fold before a model call: events up to ``position`` become checkpoint ``cycle``."""

    conversation_id: str
    turn: int
    cycle: int


class AbortInfo(msgspec.Struct, frozen=True, gc=False):
    """A turn that ended without an answer, as logged (``error``: the exception behind it,
    the model's typed error for ``model_error``, None where the abort has none or it
    was not raised here).

    The logged abort's caller-facing fields (:class:`torpor.errors.AbortFields`):
    ``error_type`` (the torpor error name, ``"ModelRateLimited"``), ``retryable``,
    ``retry_after``, ``status`` (the provider's HTTP status) and ``message``.
    """

    conversation_id: str
    turn: int
    reason: str
    detail: str = ""
    error: BaseException | None = None
    error_type: str | None = None
    retryable: bool = False
    retry_after: float | None = None
    status: int | None = None
    message: str = ""


class ModelCallWatch:
    """What the turn loop reports during a model call (the base class ignores it all)."""

    __slots__ = ()

    def first_token(self) -> None:
        """The first text arrived."""

    def usage(self, usage: Usage) -> None:
        """The provider's counts for this call."""

    def answered(self, message: AssistantMessage) -> None:
        """The call ended with this message (tool calls or a final answer)."""

    def failed(self, error: BaseException) -> None:
        """The call ended with the model's error (``error``: what the model raised)."""


class Observer:
    """Base class for observers: every hook does nothing; override the ones you need.

    Hooks run on the agent's task, inside the turn: they must be quick and must not
    raise (an exception from an observer is the turn's crash).
    """

    def origin(self) -> object | None:
        """Called in the sender's context; handed to :meth:`turn` (None: nothing to carry)."""
        return None

    def turn(self, info: TurnInfo, origin: object | None) -> AbstractContextManager[None]:
        return UNOBSERVED

    def model_call(self, info: ModelCallInfo) -> AbstractContextManager[ModelCallWatch]:
        return UNWATCHED

    def tool_call(self, info: ToolCallInfo) -> AbstractContextManager[None]:
        return UNOBSERVED

    def fold(self, info: FoldInfo) -> AbstractContextManager[None]:
        return UNOBSERVED

    def tool_result(self, info: ToolCallInfo, result: ToolResult) -> None:
        """A local tool call's result (``result.is_error``: it failed, timed out or its
        arguments did not fit), told inside its :meth:`tool_call` context."""

    def aborted(self, info: AbortInfo) -> None:
        """A turn was aborted: once for each ``Aborted`` this runtime logs, inside the
        turn's :meth:`turn` context when it was running (a postponed turn a drain ended,
        or a turn revival found cut off, has none)."""


class _Nothing:
    """A context manager that does nothing, shared (entered and left as often as needed)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __enter__(self) -> object:
        return self.value

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


_WATCH = ModelCallWatch()
# Shared do-nothing hooks (also what the turn loop enters when no observer is there)
UNOBSERVED: AbstractContextManager[None] = _Nothing(None)  # type: ignore[assignment]
UNWATCHED: AbstractContextManager[ModelCallWatch] = _Nothing(_WATCH)  # type: ignore[assignment]


class _Fanned(ModelCallWatch):
    __slots__ = ("watches",)

    def __init__(self, watches: list[ModelCallWatch]) -> None:
        self.watches = watches

    def first_token(self) -> None:
        for watch in self.watches:
            watch.first_token()

    def usage(self, usage: Usage) -> None:
        for watch in self.watches:
            watch.usage(usage)

    def answered(self, message: AssistantMessage) -> None:
        for watch in self.watches:
            watch.answered(message)

    def failed(self, error: BaseException) -> None:
        for watch in self.watches:
            watch.failed(error)


class Observers(Observer):
    """The runtime's observers as one: none, one, or several (entered in order)."""

    __slots__ = ("_all",)

    def __init__(self) -> None:
        self._all: tuple[Observer, ...] = ()

    def __bool__(self) -> bool:
        return bool(self._all)

    def __iter__(self) -> Iterator[Observer]:
        return iter(self._all)

    def add(self, observer: Observer) -> Callable[[], None]:
        """Add ``observer``; the returned function removes it again."""
        if not isinstance(observer, Observer):
            raise TypeError("an observer must subclass torpor.Observer")
        self._all += (observer,)

        def remove() -> None:
            self._all = tuple(o for o in self._all if o is not observer)

        return remove

    def origin(self) -> object | None:
        observers = self._all
        if not observers:
            return None
        if len(observers) == 1:
            return observers[0].origin()
        return tuple(o.origin() for o in observers)

    def turn(self, info: TurnInfo, origin: object | None) -> AbstractContextManager[None]:
        observers = self._all
        if not observers:
            return UNOBSERVED
        if len(observers) == 1:
            return observers[0].turn(info, origin)
        origins = origin if isinstance(origin, tuple) else (None,) * len(observers)
        return _all_of([o.turn(info, given) for o, given in zip(observers, origins,
                                                                 strict=False)])

    def model_call(self, info: ModelCallInfo) -> AbstractContextManager[ModelCallWatch]:
        observers = self._all
        if not observers:
            return UNWATCHED
        if len(observers) == 1:
            return observers[0].model_call(info)
        return _watched([o.model_call(info) for o in observers])

    def tool_call(self, info: ToolCallInfo) -> AbstractContextManager[None]:
        observers = self._all
        if not observers:
            return UNOBSERVED
        if len(observers) == 1:
            return observers[0].tool_call(info)
        return _all_of([o.tool_call(info) for o in observers])

    def fold(self, info: FoldInfo) -> AbstractContextManager[None]:
        observers = self._all
        if not observers:
            return UNOBSERVED
        if len(observers) == 1:
            return observers[0].fold(info)
        return _all_of([o.fold(info) for o in observers])

    def tool_result(self, info: ToolCallInfo, result: ToolResult) -> None:
        for observer in self._all:
            observer.tool_result(info, result)

    def aborted(self, info: AbortInfo) -> None:
        for observer in self._all:
            observer.aborted(info)


@contextlib.contextmanager
def _all_of(managers: list[AbstractContextManager[None]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


@contextlib.contextmanager
def _watched(managers: list[AbstractContextManager[ModelCallWatch]]) -> Iterator[ModelCallWatch]:
    with contextlib.ExitStack() as stack:
        yield _Fanned([stack.enter_context(manager) for manager in managers])
