"""The metrics observer: every model call, tool call, fold and aborted turn of a runtime.

``torpor.serve.app(rt, …)`` registers one on ``rt`` (``rt.observe``) as it is
made, so the figures exist whoever enters the runtime (the app's lifespan, the
host's own ``async with rt:``) and whichever model a conversation uses (its own
``AgentConfig.model`` too: models are labelled by name, which is why this is an
observer and not a wrapper around the runtime's model). A runtime nobody serves
has no observer and pays nothing.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torpor.actors.observe import (
    AbortInfo,
    FoldInfo,
    ModelCallInfo,
    ModelCallWatch,
    Observer,
    ToolCallInfo,
)
from torpor.serve.metrics import Metrics, ModelSeries

if TYPE_CHECKING:
    from collections.abc import Callable

    from torpor.events import AssistantMessage, ToolResult
    from torpor.llm.protocol import Usage
    from torpor.runtime import Runtime

__all__ = ["MetricsObserver", "observe_runtime"]


def model_name(model: object) -> str:
    """A model's label: its ``name``, as the turn loop reports it."""
    return getattr(model, "name", None) or type(model).__name__


def observe_runtime(runtime: Runtime, metrics: Metrics) -> Callable[[], None]:
    """Register a :class:`MetricsObserver` on ``runtime``; the returned function removes it.

    The series of the runtime's model (and of its default ``AgentConfig.model``) are
    made now, at zero, errors included: an alert on them works before the first call."""
    metrics.model(model_name(_unwrapped(runtime.model)))
    own = runtime.agent_config.model
    if own is not None:
        metrics.model(model_name(_unwrapped(own)))
    remove = runtime.observe(MetricsObserver(metrics))
    metrics.observing += 1
    removed = False

    def unobserve() -> None:
        nonlocal removed
        if not removed:
            removed = True
            remove()
            metrics.observing -= 1

    metrics.on_detach(unobserve)
    return unobserve


def _unwrapped(model: object) -> object:
    return getattr(model, "wrapped", model)


class MetricsObserver(Observer):
    """Reports to ``metrics``: a few attribute loads and one clock read per hook."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._tools: dict[str, tuple[Any, Any, Any]] = {}
        self._aborts: dict[tuple[str, str], Any] = {}

    def model_call(self, info: ModelCallInfo) -> _ModelCall:
        return _ModelCall(self.metrics, self.metrics.model(info.model), info.estimated_tokens)

    def tool_call(self, info: ToolCallInfo) -> _Timed:
        count, seconds, _ = self._tool(info.tool)
        return _Timed(count, seconds)

    def tool_result(self, info: ToolCallInfo, result: ToolResult) -> None:
        if result.is_error:
            self._tool(info.tool)[2].inc()

    def fold(self, info: FoldInfo) -> _Timed:
        return _Timed(self.metrics.folds, self.metrics.fold_seconds)

    def aborted(self, info: AbortInfo) -> None:
        key = (info.reason, info.error_type or "none")
        counter = self._aborts.get(key)
        if counter is None:
            counter = self._aborts[key] = self.metrics.turns_aborted.labels(*key)
        counter.inc()

    def _tool(self, name: str) -> tuple[Any, Any, Any]:
        series = self._tools.get(name)
        if series is None:
            m = self.metrics
            series = self._tools[name] = (
                m.tool_calls.labels(name), m.tool_call_seconds.labels(name),
                m.tool_errors.labels(name))
        return series


class _Timed:
    """Counts on entry, measures until exit (a tool call, a fold)."""

    __slots__ = ("count", "seconds", "started")

    def __init__(self, count: Any, seconds: Any) -> None:
        self.count = count
        self.seconds = seconds
        self.started = 0.0

    def __enter__(self) -> None:
        self.count.inc()
        self.started = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.seconds.observe(time.perf_counter() - self.started)


class _ModelCall(ModelCallWatch):
    """One model call: its own context manager and watch (one object a call)."""

    __slots__ = ("estimated", "metrics", "reported", "series", "started")

    def __init__(self, metrics: Metrics, series: ModelSeries, estimated: int) -> None:
        self.metrics = metrics
        self.series = series
        self.estimated = estimated
        self.reported: Usage | None = None
        self.started = 0.0

    def __enter__(self) -> _ModelCall:
        self.started = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.series.seconds.observe(time.perf_counter() - self.started)

    def first_token(self) -> None:
        self.metrics.observe_ttft(self.series, time.perf_counter() - self.started)

    def usage(self, usage: Usage) -> None:
        self.reported = usage

    def answered(self, message: AssistantMessage) -> None:
        usage = self.reported
        prompt = _counted(usage.prompt_tokens) if usage is not None else None
        completion = _counted(usage.completion_tokens) if usage is not None else None
        series = self.series
        series.tokens_in.inc(prompt if prompt is not None else self.estimated)
        series.tokens_out.inc(
            completion if completion is not None else (len(message.text) + 3) // 4)

    def failed(self, error: BaseException) -> None:
        self.series.error(type(error).__name__).inc()


def _counted(value: object) -> int | None:
    """A provider's count a counter can take (a hook must not raise: a negative or a
    non-int is unknown, and the estimate stands in)."""
    return value if type(value) is int and value >= 0 else None
