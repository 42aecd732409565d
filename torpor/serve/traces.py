"""The HTTP routes' side of tracing, without importing OpenTelemetry.

``torpor.otel.propagation`` is imported only once a tracing observer exists;
until then (and in a process without OpenTelemetry) these return at once.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager

from torpor.actors.observe import UNOBSERVED

__all__ = ["forwarded", "joined"]

_MODULE = "torpor.otel.propagation"


def joined(headers: Mapping[str, str]) -> AbstractContextManager[None]:
    """Entered around ``rt.send``/``rt.resolve``: the request's ``traceparent`` becomes the
    parent of the turn's span (see :func:`torpor.otel.propagation.joined`)."""
    propagation = sys.modules.get(_MODULE)
    if propagation is None:
        return UNOBSERVED
    context: AbstractContextManager[None] = propagation.joined(headers)
    return context


def forwarded(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A proxied request's headers with the current trace (see
    :func:`torpor.otel.propagation.forwarded`)."""
    propagation = sys.modules.get(_MODULE)
    if propagation is None:
        return headers
    result: list[tuple[str, str]] = propagation.forwarded(headers)
    return result
