"""Prometheus metrics for a served runtime, gathered without touching its hot paths.

Where each figure comes from:

* agents per state and the lifecycle counters (activations, revivals,
  hibernations, evictions, crashes, parks, …): ``rt.admin.stats()``, read at
  scrape time;
* revival and turn latencies (histograms) and turn counts: the admin's watch
  stream of lifecycle transitions (a turn runs from leaving ``awaiting_input``
  or ``suspended`` for ``streaming`` until it is back in one of them);
* time to first token, model-call latency, model errors by type, tokens in and
  out: :meth:`Metrics.instrument` wraps the model the runtime is built with
  (``torpor serve`` does; an embedder passes ``metrics.instrument(model)``);
* fold count and latency, group-commit batch size and commit latency: the
  ``folded`` and ``group_commit`` debug records torpor logs, tapped on their
  loggers once the host hands them over (:class:`LogTap`; ``torpor serve``
  does; the host's handlers then see exactly what they saw before);
* mailbox refusals (``Busy``), HTTP requests and open streams: the HTTP layer.

One :class:`Metrics` per app, with its own registry: no global state.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

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

from torpor._logging import event_of
from torpor.events import AssistantMessage, ToolResult
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
    from torpor.runtime.admin import RuntimeStats

__all__ = ["InstrumentedModel", "LogTap", "Metrics", "TurnClock"]

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
    """A model that reports time to first token, latency, errors and tokens to ``metrics``."""

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
        started = time.perf_counter()
        first: float | None = None
        chars = 0
        usage: Usage | None = None
        inner = self._model.stream(context, tools)
        failed = True
        try:
            async for item in inner:
                if isinstance(item, TextDelta):
                    if first is None:
                        first = time.perf_counter()
                        metrics.observe_ttft(first - started)
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
                metrics.model_errors.labels(type(exc).__name__).inc()
            else:
                failed = False
            raise
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()
            metrics.model_call_seconds.observe(time.perf_counter() - started)
            if not failed:
                prompt = usage.prompt_tokens if usage is not None else None
                completion = usage.completion_tokens if usage is not None else None
                metrics.tokens_in.inc(prompt if prompt is not None else _context_tokens(context))
                metrics.tokens_out.inc(completion if completion is not None else (chars + 3) // 4)


class LogTap(logging.Filter):
    """Reads torpor's ``folded`` and ``group_commit`` debug records into metrics.

    Logging is the host's to configure, so the host opts in: it passes the
    loggers named in :attr:`LOGGERS` to :meth:`install` (``torpor serve``
    does). The tap is a filter on each; the logger is lowered to DEBUG so the
    records exist, and the filter lets through only what passed the logger's
    previous level, so the host's handlers see no difference.
    """

    LOGGERS = ("torpor.runtime", "torpor.store.sqlite.writer", "torpor.store.postgres.writer")

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics
        self._installed: dict[str, tuple[logging.Logger, int, int]] = {}

    def install(self, loggers: Iterable[logging.Logger]) -> None:
        """Tap these loggers: the stdlib loggers named in :attr:`LOGGERS`."""
        for logger in loggers:
            if logger.name in self._installed:
                continue
            self._installed[logger.name] = (logger, logger.level, logger.getEffectiveLevel())
            logger.setLevel(logging.DEBUG)
            logger.addFilter(self)

    def uninstall(self) -> None:
        for logger, level, _ in self._installed.values():
            logger.removeFilter(self)
            logger.setLevel(level)
        self._installed.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.DEBUG:
            event = event_of(record)
            seconds = getattr(record, "seconds", None)
            if event == "group_commit" and isinstance(seconds, float):
                ops = getattr(record, "ops", None)
                if isinstance(ops, int):
                    self._metrics.commit_batch_size.observe(ops)
                self._metrics.commit_seconds.observe(seconds)
            elif event == "folded" and isinstance(seconds, float):
                self._metrics.folds.inc()
                self._metrics.fold_seconds.observe(seconds)
        installed = self._installed.get(record.name)
        return installed is None or record.levelno >= installed[2]


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
            buckets=_LATENCY_BUCKETS, registry=r)
        self.model_call_seconds = Histogram(
            "torpor_model_call_seconds", "Duration of model calls", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.model_errors = Counter("torpor_model_errors", "Model calls that failed, by type",
                                    ["type"], registry=r)
        self.tokens = Counter("torpor_tokens", "Tokens sent to and received from the model "
                              "(provider counts, else torpor's estimate)", ["direction"],
                              registry=r)
        self.tokens_in = self.tokens.labels("in")  # looked up once, not per call
        self.tokens_out = self.tokens.labels("out")
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
        self.requests = Counter("torpor_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.open_streams = Gauge("torpor_sse_streams", "Open Server-Sent Events streams",
                                  registry=r)
        self.recent_ttft: deque[float] = deque(maxlen=4096)
        self.clock = TurnClock(self)
        self.tap = LogTap(self)

    def instrument(self, model: Model) -> InstrumentedModel:
        """Wrap the runtime's model so its calls are measured (time to first token, …)."""
        if isinstance(model, InstrumentedModel):
            return model
        return InstrumentedModel(model, self)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_seconds.observe(seconds)
        self.recent_ttft.append(seconds)

    def render(self, stats: RuntimeStats) -> bytes:
        """The exposition text, with agents and counters as of ``stats``."""
        self._stats.stats = stats
        return generate_latest(self.registry)
