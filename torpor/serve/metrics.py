"""Prometheus metrics for a served runtime, gathered without touching its hot paths.

Where each figure comes from:

* agents per state and the lifecycle counters (activations, revivals,
  hibernations, evictions, crashes, parks, …): ``rt.admin.stats()``, read at
  scrape time;
* pending approvals (conversations and calls waiting for an outside answer,
  evicted ones included, and the oldest one's age): the store's index, one
  aggregate read at scrape time (``store.pending_summary()``);
* revival and turn latencies (histograms) and turn counts: the admin's watch
  stream of lifecycle transitions (a turn runs from leaving ``awaiting_input``
  or ``suspended`` for ``streaming`` until it is back in one of them);
* model calls (latency, time to first token, errors by type, tokens in and out,
  labelled by ``model``: a conversation's own ``AgentConfig.model`` too), tool
  calls (count, latency, errors, by ``tool``), aborted turns (by ``reason`` and
  ``error``) and folds (count, latency): an observer the app registers on the
  runtime (:mod:`torpor.serve.observer`), whoever enters the runtime;
* group-commit batch size and commit latency: the ``group_commit`` debug
  records of the store's writers, tapped on their loggers while the app's
  service runs (:class:`LogTap`; the host's handlers see exactly what they saw
  before);
* mailbox refusals (``Busy``), HTTP requests and open streams: the HTTP layer.

One :class:`Metrics` per app, with its own registry: no global state.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from torpor._logging import event_of, stdlib_logger
from torpor.errors import ModelError
from torpor.events import AbortReason, AssistantMessage, ToolResult
from torpor.llm.protocol import (
    CONTEXT_TOKENS,
    ContextMessage,
    StreamEvent,
    TextDelta,
    ToolSpec,
    Usage,
)
from torpor.runtime.stats import Transition, percentile

if TYPE_CHECKING:
    from torpor.llm.protocol import Model
    from torpor.runtime import Runtime
    from torpor.runtime.admin import RuntimeStats
    from torpor.store.protocol import PendingSummary

__all__ = ["ABORT_REASONS", "MODEL_ERROR_TYPES", "InstrumentedModel", "LogTap", "Metrics",
           "ModelSeries", "TurnClock", "pending_figures"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_COUNTERS = (
    ("activations", "Agent records created for conversations not in memory"),
    ("revivals", "Working sets read back from the log"),
    ("hibernations", "Agents that dropped their working set"),
    ("evictions", "Agents forgotten (the log keeps everything)"),
    ("crashes", "Agent crashes"),
    ("restarts", "Agent restarts by the supervisor"),
    ("parks", "Agents parked after crashing too often"),
    ("store_failures", "Turns or revivals stopped by an unavailable store"),
    ("abandoned", "Tasks abandoned after ignoring cancellation"),
    ("consolidation_failures", "Idle-sweep consolidations that failed or timed out"),
    ("retention_deletions", "Conversations deleted by the retention sweep"),
)
_BUSY = frozenset({"streaming", "running_tools"})
_RESTING = frozenset({"awaiting_input", "suspended"})


class _StatsCollector(Collector):
    """Exposes the last ``rt.admin.stats()`` snapshot (taken by the scrape itself)."""

    def __init__(self) -> None:
        self.stats: RuntimeStats | None = None

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        if stats is None:
            return
        agents = GaugeMetricFamily("torpor_agents", "Agents in memory by state",
                                   labels=["state"])
        for state, count in sorted(stats.states.items()):
            agents.add_metric([state], count)
        yield agents
        for name, help_text, value in (
            ("torpor_agents_live", "Agents in memory (hibernated included)", stats.live),
            ("torpor_agents_hibernated", "Agents in memory without a working set",
             stats.hibernated),
            ("torpor_agents_with_working_set", "Agents holding a working set",
             stats.with_working_set),
            ("torpor_agent_tasks", "Agent tasks running", stats.tasks),
            ("torpor_working_set_bytes", "Estimated bytes of every working set",
             stats.working_set_bytes),
            ("torpor_admission_queued", "Conversations waiting for a live slot", stats.queued),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        for field, help_text in _COUNTERS:
            yield CounterMetricFamily(f"torpor_{field}", help_text,
                                      value=getattr(stats, field))


class TurnClock:
    """Turn and revival latencies from lifecycle transitions, for metrics and ``torpor top``."""

    __slots__ = ("_metrics", "_revival_started", "_turn_started", "turn_ends", "turn_seconds",
                 "turns")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._turn_started: dict[str, float] = {}
        self._revival_started: dict[str, float] = {}
        self.turns = 0
        self.turn_seconds: deque[float] = deque(maxlen=4096)
        self.turn_ends: deque[float] = deque(maxlen=4096)

    def observe(self, t: Transition) -> None:
        cid = t.conversation_id
        if t.new == "reviving":
            self._revival_started[cid] = t.at
        elif t.old == "reviving":
            started = self._revival_started.pop(cid, None)
            if started is not None:
                self._metrics.revival_seconds.observe(max(0.0, t.at - started))
        if t.new == "streaming" and t.old in _RESTING:
            self._turn_started[cid] = t.at
        elif t.old in _BUSY and t.new != "streaming" and t.new != "running_tools":
            started = self._turn_started.pop(cid, None)
            if started is not None and t.new in _RESTING:
                seconds = max(0.0, t.at - started)
                self.turns += 1
                self.turn_seconds.append(seconds)
                self.turn_ends.append(t.at)
                self._metrics.turns.inc()
                self._metrics.turn_seconds.observe(seconds)
        if t.new == "evicted":
            self._turn_started.pop(cid, None)
            self._revival_started.pop(cid, None)

    def summary(self) -> dict[str, Any]:
        samples = list(self.turn_seconds)
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        ttft = list(self._metrics.recent_ttft)
        t50, t99 = percentile(ttft, 50), percentile(ttft, 99)
        return {
            "turns": self.turns,
            "turn_p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "turn_p99_ms": None if p99 is None else round(p99 * 1000, 3),
            "ttft_p50_ms": None if t50 is None else round(t50 * 1000, 3),
            "ttft_p99_ms": None if t99 is None else round(t99 * 1000, 3),
        }


def _context_tokens(context: Sequence[ContextMessage]) -> int:
    """What the runtime counted when it assembled ``context`` (O(1)); a chars/4 estimate
    for a call the runtime did not make."""
    counted = CONTEXT_TOKENS.get()
    return counted if counted is not None else (_context_chars(context) + 3) // 4


def _context_chars(context: Sequence[ContextMessage]) -> int:
    total = 0
    for message in context:
        if isinstance(message, ToolResult):
            total += len(message.content)
        elif isinstance(message, AssistantMessage):
            total += len(message.text) + sum(len(str(c.arguments)) for c in message.tool_calls)
        else:
            total += len(message.text)
    return total


class InstrumentedModel:
    """A model that reports time to first token, latency, errors and tokens to ``metrics``.

    Deprecated: an app made by :func:`torpor.serve.app` measures every model call of
    its runtime itself (an observer, which also sees each conversation's own
    ``AgentConfig.model``). Kept working: while that observer is registered on
    ``metrics`` this wrapper measures nothing, so no call is counted twice.
    """

    __slots__ = ("_metrics", "_model", "name")

    def __init__(self, model: Model, metrics: Metrics) -> None:
        self._model = model
        self._metrics = metrics
        self.name = model.name

    @property
    def wrapped(self) -> Model:
        return self._model

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        metrics = self._metrics
        inner = self._model.stream(context, tools)
        if metrics.observing:  # the app's observer measures this call: pass it through
            try:
                async for item in inner:
                    yield item
            finally:
                aclose = getattr(inner, "aclose", None)
                if aclose is not None:
                    await aclose()
            return
        series = metrics.model(self.name)
        started = time.perf_counter()
        first: float | None = None
        chars = 0
        usage: Usage | None = None
        failed = True
        try:
            async for item in inner:
                if isinstance(item, TextDelta):
                    if first is None:
                        first = time.perf_counter()
                        metrics.observe_ttft(series, first - started)
                    chars += len(item.text)
                elif isinstance(item, Usage):
                    usage = item
                yield item
            failed = False
        except GeneratorExit:
            failed = False  # closed by the turn (a cancel): not the model's error
            raise
        except BaseException as exc:
            if isinstance(exc, Exception):
                series.error(type(exc).__name__).inc()
            else:
                failed = False
            raise
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()
            series.seconds.observe(time.perf_counter() - started)
            if not failed:
                prompt = usage.prompt_tokens if usage is not None else None
                completion = usage.completion_tokens if usage is not None else None
                series.tokens_in.inc(prompt if prompt is not None else _context_tokens(context))
                series.tokens_out.inc(completion if completion is not None else (chars + 3) // 4)


class LogTap(logging.Filter):
    """Reads the store writers' ``group_commit`` debug records into metrics.

    Installed on the loggers named in :attr:`LOGGERS` while an app's service
    runs (it does this itself: the host does nothing). The tap is a filter on
    each; the logger is lowered to DEBUG so the records exist, and the filter lets
    through only what passed the logger's previous level, so the host's handlers
    see no difference. Folds are measured by the app's observer instead.
    """

    LOGGERS = ("torpor.store.sqlite.writer", "torpor.store.postgres.writer")

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics
        self._installed: dict[str, tuple[logging.Logger, int, int]] = {}

    def install(self, loggers: Iterable[logging.Logger] | None = None) -> None:
        """Tap these loggers (default: those named in :attr:`LOGGERS`)."""
        if loggers is None:
            loggers = [stdlib_logger(name) for name in self.LOGGERS]
        for logger in loggers:
            if logger.name in self._installed:
                continue
            level = logger.level
            for other in logger.filters:  # another app's tap: the host's level is its record
                if isinstance(other, LogTap) and logger.name in other._installed:
                    level = other._installed[logger.name][1]
            self._installed[logger.name] = (logger, level, logger.getEffectiveLevel())
            logger.setLevel(logging.DEBUG)
            logger.addFilter(self)

    def uninstall(self) -> None:
        for logger, level, _ in self._installed.values():
            logger.removeFilter(self)
            if not any(isinstance(other, LogTap) for other in logger.filters):
                logger.setLevel(level)  # the last tap gone: the host's level again
        self._installed.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.DEBUG:
            seconds = getattr(record, "seconds", None)
            if isinstance(seconds, float) and event_of(record) == "group_commit":
                ops = getattr(record, "ops", None)
                if isinstance(ops, int):
                    self._metrics.commit_batch_size.observe(ops)
                self._metrics.commit_seconds.observe(seconds)
        installed = self._installed.get(record.name)
        if installed is None:
            return True
        # The level the host's configuration gives the logger now (it may change while
        # tapped): the logger's own level from before, else what its parents say.
        logger, level, _ = installed
        if level == logging.NOTSET and logger.parent is not None:
            level = logger.parent.getEffectiveLevel()
        return record.levelno >= level


class ModelSeries:
    """One model's labelled series, looked up once (a ``labels()`` call per model call
    would cost more than the rest of the measuring). Its error series exist, at zero,
    for every :class:`~torpor.errors.ModelError` type from the start."""

    __slots__ = ("_errors", "_metrics", "name", "seconds", "tokens_in", "tokens_out", "ttft")

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._metrics = metrics
        self.name = name
        self.seconds = metrics.model_call_seconds.labels(name)
        self.ttft = metrics.ttft_seconds.labels(name)
        self.tokens_in = metrics.tokens.labels(name, "in")
        self.tokens_out = metrics.tokens.labels(name, "out")
        self._errors: dict[str, Any] = {
            kind: metrics.model_errors.labels(name, kind) for kind in MODEL_ERROR_TYPES
        }

    def error(self, kind: str) -> Any:
        """The error counter of type ``kind`` (any exception's class name)."""
        counter = self._errors.get(kind)
        if counter is None:
            counter = self._errors[kind] = self._metrics.model_errors.labels(self.name, kind)
        return counter


def _model_error_types() -> tuple[str, ...]:
    found: list[str] = []
    todo: list[type] = [ModelError]
    while todo:
        cls = todo.pop(0)
        if cls.__module__ == ModelError.__module__ and cls.__name__ not in found:
            found.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return tuple(found)


MODEL_ERROR_TYPES = _model_error_types()
"""Every model error type torpor defines (``ModelError`` and its subclasses)."""
ABORT_REASONS: tuple[str, ...] = get_args(AbortReason)


class Metrics:
    """The app's Prometheus registry and every metric in it."""

    def __init__(self, *, process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._stats = _StatsCollector()
        r.register(self._stats)
        if process:
            ProcessCollector(registry=r)
        self.revival_seconds = Histogram(
            "torpor_revival_seconds", "From reviving to ready (queueing for a slot included)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.turns = Counter("torpor_turns", "Turns (each stream) that reached their end",
                             registry=r)
        self.turn_seconds = Histogram(
            "torpor_turn_seconds", "From a turn's first model call to its answer or suspension",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram(
            "torpor_time_to_first_token_seconds", "From a model call to its first text",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.model_call_seconds = Histogram(
            "torpor_model_call_seconds", "Duration of model calls", ["model"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.model_errors = Counter("torpor_model_errors", "Model calls that failed, by type",
                                    ["model", "type"], registry=r)
        self.tokens = Counter("torpor_tokens", "Tokens sent to and received from the model "
                              "(provider counts, else torpor's estimate)",
                              ["model", "direction"], registry=r)
        self.tool_calls = Counter("torpor_tool_calls", "Local tool calls, by tool", ["tool"],
                                  registry=r)
        self.tool_call_seconds = Histogram(
            "torpor_tool_call_seconds", "Duration of local tool calls", ["tool"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.tool_errors = Counter(
            "torpor_tool_errors", "Local tool calls whose result is an error (raised, timed "
            "out, arguments refused)", ["tool"], registry=r)
        self.turns_aborted = Counter(
            "torpor_turns_aborted", "Turns aborted, by reason and error type (none: no error "
            "type, as for a cancel or a shutdown)", ["reason", "error"], registry=r)
        self.folds = Counter("torpor_folds", "Compaction folds (checkpoints written)",
                             registry=r)
        self.fold_seconds = Histogram("torpor_fold_seconds", "Duration of a fold",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.commit_batch_size = Histogram(
            "torpor_group_commit_batch_size", "Write operations per group commit",
            buckets=_BATCH_BUCKETS, registry=r)
        self.commit_seconds = Histogram(
            "torpor_group_commit_seconds", "Duration of a group commit",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.mailbox_refusals = Counter(
            "torpor_mailbox_refusals", "Messages refused with Busy (mailbox_bound reached)",
            registry=r)
        self.pending_conversations = Gauge(
            "torpor_pending_approvals", "Conversations waiting for an outside answer (evicted "
            "ones included; the whole store's)", registry=r)
        self.pending_calls = Gauge(
            "torpor_pending_calls", "Tool calls waiting for an outside answer", registry=r)
        self.pending_oldest = Gauge(
            "torpor_pending_approval_oldest_seconds", "Age of the oldest call waiting for an "
            "outside answer (0: none waits)", registry=r)
        self.requests = Counter("torpor_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.open_streams = Gauge("torpor_sse_streams", "Open Server-Sent Events streams",
                                  registry=r)
        # aborted-turn series exist at zero from the start: alerts can be written before
        # the first one (model errors: per model, see ModelSeries)
        for reason in ABORT_REASONS:
            if reason == "model_error":
                for kind in MODEL_ERROR_TYPES:
                    self.turns_aborted.labels(reason, kind)
            else:
                self.turns_aborted.labels(reason, "StepLimit" if reason == "step_limit"
                                          else "none")
        self.recent_ttft: deque[float] = deque(maxlen=4096)
        self.observing = 0  # runtimes whose observer reports to these metrics
        self._detach: list[Callable[[], None]] = []
        self._models: dict[str, ModelSeries] = {}
        self.clock = TurnClock(self)
        self.tap = LogTap(self)

    def on_detach(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` when the app stops (:meth:`detach`): an observer's removal, say."""
        self._detach.append(undo)

    def detach(self) -> None:
        """The app stopped: untap the loggers and remove the observers it registered (a
        runtime that outlives its app no longer reports to it)."""
        self.tap.uninstall()
        undo, self._detach = self._detach, []
        for step in undo:
            step()

    def model(self, name: str) -> ModelSeries:
        """The series of the model called ``name`` (created, at zero, on first use)."""
        series = self._models.get(name)
        if series is None:
            series = self._models[name] = ModelSeries(self, name)
        return series

    def instrument(self, model: Model) -> InstrumentedModel:
        """Wrap a model so its calls are measured (time to first token, …).

        Deprecated: an app made by :func:`torpor.serve.app` measures every model of
        its runtime without it (see :class:`InstrumentedModel`)."""
        if isinstance(model, InstrumentedModel):
            return model
        return InstrumentedModel(model, self)

    def observe_ttft(self, series: ModelSeries, seconds: float) -> None:
        series.ttft.observe(seconds)
        self.recent_ttft.append(seconds)

    def render(self, stats: RuntimeStats, pending: PendingSummary | None = None) -> bytes:
        """The exposition text, with agents and counters as of ``stats`` (and pending
        approvals as of ``pending``)."""
        self._stats.stats = stats
        if pending is not None:
            figures = pending_figures(pending)
            self.pending_conversations.set(figures["conversations"])
            self.pending_calls.set(figures["calls"])
            self.pending_oldest.set(figures["oldest_seconds"])
        return generate_latest(self.registry)

    def failures(self) -> dict[str, dict[str, int]]:
        """Model errors by type (every model's) and aborted turns by reason, those not zero
        (``/admin/stats`` shows them; ``torpor top`` reads them there)."""
        return {
            "model_errors": _totals(self.model_errors, "type"),
            "aborted": _totals(self.turns_aborted, "reason"),
        }

    async def scrape(self, runtime: Runtime) -> bytes:
        """What ``/metrics`` answers: the figures read at scrape time, then every series."""
        return self.render(await runtime.admin.stats(), await runtime.store.pending_summary())


def pending_figures(pending: PendingSummary) -> dict[str, Any]:
    """Pending approvals as shown: counts, and the oldest call's age in seconds (0: none)."""
    oldest = pending.oldest
    age = 0.0 if oldest is None else max(0.0, round(time.time() - oldest / 1000.0, 3))
    return {"conversations": pending.conversations, "calls": pending.calls,
            "oldest_seconds": age}


def _totals(counter: Counter, label: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                key = sample.labels[label]
                totals[key] = totals.get(key, 0) + int(sample.value)
    return totals
