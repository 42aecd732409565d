"""The HTTP face of torpor: a mountable Starlette app and what ``torpor serve`` runs.

Needs the ``serve`` extra: ``pip install 'torpor[serve]'``.

>>> application = torpor.serve.app(rt, authorize=torpor.serve.bearer_token(tok),
...                                admin_token=admin_tok)
"""

from torpor.serve.access import (
    Action,
    AdminClients,
    Authorize,
    allow_all,
    bearer_of,
    bearer_token,
    bearer_tokens,
)
from torpor.serve.app import app, drain, service_of
from torpor.serve.logs import ContextFilter
from torpor.serve.metrics import InstrumentedModel, Metrics
from torpor.serve.observer import MetricsObserver
from torpor.serve.problems import Draining, Forbidden, HTTPProblem, OwnerUnreachable, Unauthorized
from torpor.serve.runner import Server, bind, serve
from torpor.serve.service import Service
from torpor.serve.sse import Cursor, format_cursor, parse_cursor
from torpor.serve.tickets import StreamTickets

__all__ = [
    "Action",
    "AdminClients",
    "Authorize",
    "ContextFilter",
    "Cursor",
    "Draining",
    "Forbidden",
    "HTTPProblem",
    "InstrumentedModel",
    "Metrics",
    "MetricsObserver",
    "OwnerUnreachable",
    "Server",
    "Service",
    "StreamTickets",
    "Unauthorized",
    "allow_all",
    "app",
    "bearer_of",
    "bearer_token",
    "bearer_tokens",
    "bind",
    "drain",
    "format_cursor",
    "parse_cursor",
    "serve",
    "service_of",
]
