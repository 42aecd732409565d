"""OpenTelemetry traces of turns, model calls, tool calls and folds (``pip install torpor[otel]``).

Off unless OpenTelemetry is configured: a ``Runtime`` entered while a global
tracer provider is set (``opentelemetry.trace.set_tracer_provider``, or a
process started under ``opentelemetry-instrument``) adds a
:class:`TracingObserver` itself; otherwise nothing is observed, and a process
that never imported OpenTelemetry never imports it. :func:`instrument` adds one
explicitly, with a provider of its own if given.

Spans follow the GenAI semantic conventions (see :mod:`torpor.otel.spans`). Under
``torpor.serve`` an HTTP request's W3C ``traceparent`` is the parent of the turn
it starts or continues, also when that turn runs later (postponed behind another)
or on another node (a proxied request forwards it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from torpor.actors.observe import Observer, Observers
from torpor.otel.spans import TracingObserver

__all__ = ["TracingObserver", "configured", "instrument"]


class Observable(Protocol):
    """What :func:`instrument` needs of a runtime (a ``torpor.Runtime``)."""

    def observe(self, observer: Observer) -> Callable[[], None]: ...


def configured() -> bool:
    """Whether a global tracer provider is set (not the API's default proxy or a no-op)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def instrument(rt: Observable, tracer_provider: TracerProvider | None = None) -> Callable[[], None]:
    """Trace ``rt``'s turns (to ``tracer_provider``, else the global one); the returned
    function stops that."""
    return rt.observe(TracingObserver(tracer_provider))


def automatic(observers: Observers) -> Callable[[], None] | None:
    """What ``Runtime.__aenter__`` calls when OpenTelemetry is loaded: a tracing observer
    when a global tracer provider is configured and none was added already."""
    if not configured() or any(isinstance(o, TracingObserver) for o in observers):
        return None
    return observers.add(TracingObserver())
