"""The tracing observer: OpenTelemetry spans for turns, model calls, tool calls and folds.

Span names and attributes follow the OpenTelemetry GenAI semantic conventions
(agent, inference and execute-tool spans):

* ``invoke_agent`` (INTERNAL) per turn, or per part of a turn after a suspension
  was answered: ``gen_ai.operation.name`` ``invoke_agent``, ``gen_ai.conversation.id``,
  ``torpor.turn``, ``torpor.continuation``, ``torpor.postponed``. Its parent is the
  sender's trace (an HTTP request's ``traceparent``), carried to a postponed turn.
* ``chat {model}`` (CLIENT) per model call: ``gen_ai.request.model``,
  ``gen_ai.provider.name``, ``gen_ai.usage.input_tokens`` / ``output_tokens``,
  ``gen_ai.usage.cache_read.input_tokens`` / ``cache_creation.input_tokens``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk``; a
  failed call sets ``error.type`` (the torpor error's name) and the ERROR status.
* ``execute_tool {name}`` (INTERNAL) per local tool call: ``gen_ai.tool.name``,
  ``gen_ai.tool.call.id``, ``gen_ai.tool.type``; a failed call (an error result: the tool
  raised, timed out or got arguments it refused) has ``error.type`` ``tool_error`` and the
  ERROR status. A tool's own spans nest under it.
* ``fold`` (INTERNAL) per fold of the working set: ``torpor.fold.cycle``.

An aborted turn's span gets the ERROR status, ``torpor.abort.reason`` and ``error.type``.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from torpor.actors.observe import (
    AbortInfo,
    FoldInfo,
    ModelCallInfo,
    ModelCallWatch,
    Observer,
    ToolCallInfo,
    TurnInfo,
)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from torpor.events import AssistantMessage, ToolResult
    from torpor.llm.protocol import Usage

__all__ = ["TracingObserver"]

_ROOT = Context()  # a turn nobody traced starts a trace of its own
_TURN: ContextVar[_TurnSpan | None] = ContextVar("torpor_otel_turn", default=None)
_STOP = ("stop",)
_TOOL_CALLS = ("tool_calls",)


class _Span:
    """A span made current while its work runs, ended when it leaves; an exception other
    than a cancel marks it failed (a cancel is the turn's abort, told by ``aborted``)."""

    __slots__ = ("_failed", "_token", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: object = None
        self._failed = False

    def fail(self, error: BaseException) -> None:
        """Mark the span failed by ``error`` (the first error told wins: a model's own
        error, not the ModelFailed the turn loop wraps it in as it leaves)."""
        if not self._failed:
            self._failed = True
            _fail(self.span, error)

    def _context(self) -> Context:
        return trace.set_span_in_context(self.span)

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._context())

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if isinstance(exc, Exception):
                self.fail(exc)
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self.span.end()


class _TurnSpan(_Span):
    __slots__ = ("_parent", "_turn", "info")

    def __init__(self, span: Span, parent: Context, info: TurnInfo) -> None:
        super().__init__(span)
        self._parent = parent
        self.info = info
        self._turn: Token[_TurnSpan | None] | None = None

    def _context(self) -> Context:
        return trace.set_span_in_context(self.span, self._parent)  # the sender's baggage too

    def __enter__(self) -> None:
        super().__enter__()
        self._turn = _TURN.set(self)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._turn is not None:
            _TURN.reset(self._turn)
        super().__exit__(kind, exc, tb)


class _ModelSpan(_Span, ModelCallWatch):
    """A model call's span, and the watch the turn loop reports the call's progress to."""

    __slots__ = ("_started",)

    def __init__(self, span: Span) -> None:
        super().__init__(span)
        self._started = time.perf_counter()

    def __enter__(self) -> ModelCallWatch:  # type: ignore[override]
        super().__enter__()
        return self

    def first_token(self) -> None:
        self.span.set_attribute("gen_ai.response.time_to_first_chunk",
                                time.perf_counter() - self._started)

    def usage(self, usage: Usage) -> None:
        span = self.span
        if usage.prompt_tokens is not None:  # the whole prompt, cached parts included
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        if usage.completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        if usage.cache_read_tokens is not None:
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens)
        if usage.cache_write_tokens is not None:
            span.set_attribute("gen_ai.usage.cache_creation.input_tokens",
                               usage.cache_write_tokens)

    def answered(self, message: AssistantMessage) -> None:
        self.span.set_attribute("gen_ai.response.finish_reasons",
                                _TOOL_CALLS if message.tool_calls else _STOP)

    def failed(self, error: BaseException) -> None:
        self.fail(error)


def _error_type(error: BaseException) -> str:
    return type(error).__name__  # torpor's typed errors: ModelRateLimited, ModelTimeout, …


def _fail(span: Span, error: BaseException) -> None:
    if not span.is_recording():
        return
    span.set_attribute("error.type", _error_type(error))
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{_error_type(error)}: {error}"))


class TracingObserver(Observer):
    """OpenTelemetry spans for every turn, model call, tool call and fold.

    ``tracer_provider``: where spans go (None: the global one, as configured by
    ``opentelemetry.trace.set_tracer_provider`` or ``opentelemetry-instrument``).
    Add it with ``rt.observe(TracingObserver())`` or :func:`torpor.otel.instrument`;
    ``Runtime`` adds one itself when a global tracer provider is configured.
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from torpor.otel import propagation

        propagation.enable()  # the HTTP routes now carry a request's traceparent
        self.tracer: Tracer = trace.get_tracer("torpor", _version(),
                                               tracer_provider=tracer_provider)

    def origin(self) -> object | None:
        current = otel_context.get_current()
        # Only a traced sender's context is kept (a postponed turn holds it meanwhile).
        return current if trace.get_current_span(current).get_span_context().is_valid else None

    def turn(self, info: TurnInfo, origin: object | None) -> AbstractContextManager[None]:
        # Always an explicit parent: the actor's task inherited the context of whichever
        # request first woke the agent, which is no parent of this turn.
        parent = origin if isinstance(origin, Context) else _ROOT
        span = self.tracer.start_span("invoke_agent", parent, SpanKind.INTERNAL, {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": info.conversation_id,
            "torpor.turn": info.turn,
            "torpor.continuation": info.continuation,
            "torpor.postponed": info.postponed,
        }, record_exception=False, set_status_on_exception=False)
        return _TurnSpan(span, parent, info)

    def model_call(self, info: ModelCallInfo) -> AbstractContextManager[ModelCallWatch]:
        model = info.request_model or info.model
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": info.conversation_id,
            "torpor.turn": info.turn,
            "torpor.model_call": info.call_index,
            "torpor.model": info.model,
            "torpor.estimated_input_tokens": info.estimated_tokens,
        }
        if info.provider is not None:
            attributes["gen_ai.provider.name"] = info.provider
        span = self.tracer.start_span(f"chat {model}", None, SpanKind.CLIENT, attributes,
                                      record_exception=False, set_status_on_exception=False)
        return _ModelSpan(span)

    def tool_call(self, info: ToolCallInfo) -> AbstractContextManager[None]:
        span = self.tracer.start_span(f"execute_tool {info.tool}", None, SpanKind.INTERNAL, {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": info.tool,
            "gen_ai.tool.call.id": info.call_id,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": info.conversation_id,
        }, record_exception=False, set_status_on_exception=False)
        return _Span(span)

    def tool_result(self, info: ToolCallInfo, result: ToolResult) -> None:
        # Told inside the tool call's context: the current span is its execute_tool span.
        if result.is_error:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attribute("error.type", "tool_error")
                span.set_status(Status(StatusCode.ERROR, "the tool call failed"))

    def fold(self, info: FoldInfo) -> AbstractContextManager[None]:
        span = self.tracer.start_span("fold", None, SpanKind.INTERNAL, {
            "gen_ai.conversation.id": info.conversation_id,
            "torpor.turn": info.turn,
            "torpor.fold.cycle": info.cycle,
        }, record_exception=False, set_status_on_exception=False)
        return _Span(span)

    def aborted(self, info: AbortInfo) -> None:
        turn = _TURN.get()
        if turn is not None and (turn.info.conversation_id, turn.info.turn) == (
            info.conversation_id, info.turn
        ):
            _aborted(turn.span, info)
            return
        # Ended outside a running turn (a suspended turn cancelled, an interrupted one
        # found on revival): a span of its own, so the abort is still seen.
        span = self.tracer.start_span("invoke_agent", _ROOT, SpanKind.INTERNAL, {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": info.conversation_id,
            "torpor.turn": info.turn,
        })
        _aborted(span, info)
        span.end()


def _aborted(span: Span, info: AbortInfo) -> None:
    if not span.is_recording():
        return
    error = info.error
    span.set_attribute("torpor.abort.reason", info.reason)
    span.set_attribute("error.type", _error_type(error) if error is not None else info.reason)
    span.set_status(Status(StatusCode.ERROR, f"{info.reason}: {info.detail}"
                           if info.detail else info.reason))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torpor")
    except PackageNotFoundError:
        return "0"
