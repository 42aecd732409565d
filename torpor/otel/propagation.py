"""W3C trace context across HTTP: a request's ``traceparent`` as the parent of its turn,
and the current trace forwarded with a request proxied to another node.

Enabled once a :class:`~torpor.otel.TracingObserver` exists in the process; until
then both functions do nothing (``torpor.serve.traces`` calls them only once this
module was imported, so a process without OpenTelemetry never imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from types import TracebackType

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context

from torpor.actors.observe import UNOBSERVED

__all__ = ["enable", "forwarded", "joined"]

_enabled = False
_FIELDS = ("traceparent", "tracestate")


def enable() -> None:
    global _enabled
    _enabled = True


class _Attached:
    __slots__ = ("_context", "_token")

    def __init__(self, context: Context) -> None:
        self._context = context
        self._token: object = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._context)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]


def joined(headers: Mapping[str, str]) -> AbstractContextManager[None]:
    """The request's trace made current while a message is sent or a call resolved (so
    ``Observer.origin`` carries it to the turn). A host running OpenTelemetry's ASGI
    middleware already made its server span current, a child of that same trace: kept."""
    if not _enabled or "traceparent" not in headers:
        return UNOBSERVED
    if trace.get_current_span().get_span_context().is_valid:
        return UNOBSERVED
    return _Attached(propagate.extract(headers))  # the configured propagators (W3C default)


def forwarded(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Headers of a request proxied to the owner: the current span (the host's server span)
    as their trace context when there is one; else the client's own, passed through."""
    if not _enabled or not trace.get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() not in _FIELDS and k.lower() not in carrier]
    return kept + list(carrier.items())
