"""``torpor.serve.app(runtime, …)``: the whole HTTP face as one mountable Starlette app."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torpor._logging import get_logger
from torpor.errors import TorporError
from torpor.runtime import Runtime
from torpor.serve.access import AdminClients, Authorize
from torpor.serve.admin import admin_routes
from torpor.serve.ai_sdk import ai_sdk_routes
from torpor.serve.chat import chat_routes
from torpor.serve.conversations import conversation_routes
from torpor.serve.deferred import DEFER, Deferred, deferred
from torpor.serve.logs import conversation_id_var, request_id_var
from torpor.serve.metrics import Metrics
from torpor.serve.observer import observe_runtime
from torpor.serve.page import page_routes
from torpor.serve.problems import HTTPProblem, problem, problem_for
from torpor.serve.proxy import Proxy, Routing
from torpor.serve.schedules import schedule_routes
from torpor.serve.service import Service
from torpor.serve.sse_response import PING_SECONDS
from torpor.serve.tickets import DEFAULT_TICKET_TTL, StreamTickets

__all__ = ["app", "drain", "service_of"]

log = get_logger("torpor.serve")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class _RequestIds:
    """Request ids unique across processes and restarts: a random prefix per process and a
    counter (one ``token_hex`` per request cost ~20 µs of a turn). Ids say nothing secret."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)  # a forked worker is another process

    def reseed(self) -> None:
        self.prefix = secrets.token_hex(4)
        self.counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):08x}"


_request_ids = _RequestIds()


class RequestContext:
    """Pure ASGI middleware: a request id (``X-Request-ID``), bound ids, an access record,
    and request counts by route (streams are not buffered, unlike BaseHTTPMiddleware).
    Streaming routes run here, once the routing layers below have returned (see
    :mod:`torpor.serve.deferred`); a stream's access record comes when it ends."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        # (method, route, status) -> its counter and its access record's level: a labels()
        # lookup per request costs more
        self._counted: dict[tuple[str, str, int], tuple[Any, int]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                given = value.decode("latin-1")
        request_id = given if given and _REQUEST_ID.fullmatch(given) else _request_ids.next()
        scope.setdefault("state", {})["request_id"] = request_id
        request_id_var.set(request_id)
        conversation_id_var.set(None)
        started = time.perf_counter()
        send_with_id = _WithId(send, request_id)
        later: list[Deferred] = []
        scope[DEFER] = later
        try:
            await self.app(scope, receive, send_with_id)
            endpoint = deferred(later, scope)
            if endpoint is not None:  # a streaming route: run here, no routing frames kept
                response = await endpoint.respond(scope, receive, send_with_id)
                await response(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            status = send_with_id.status
            method = scope["method"]
            key = (method, template, status)
            counted = self._counted.get(key)
            if counted is None:  # routes x methods x statuses: a bounded set
                counted = self._counted[key] = (
                    self.metrics.requests.labels(method, template, str(status)),
                    _access_level(template))
            counter, level = counted
            counter.inc()
            if log.isEnabledFor(level):  # nothing built for a level the host does not log
                log.log(level, "request", method=method, path=scope["path"], status=status,
                        ms=round((time.perf_counter() - started) * 1000, 3))


def _access_level(template: str) -> int:
    """Monitoring (health checks, scrapes, the admin a dashboard polls) logs its requests
    at debug: at info they drowned the records an operator acts on."""
    if template in ("/healthz", "/metrics") or template.startswith("/admin"):
        return logging.DEBUG
    return logging.INFO


class _WithId:
    """``send`` that adds the request id to the response's headers and notes its status
    (an object, not a closure: an open stream keeps it, and cells cost more)."""

    __slots__ = ("request_id", "send", "status")

    def __init__(self, send: Send, request_id: str) -> None:
        self.send = send
        self.request_id = request_id
        self.status = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = list(message.get("headers", ()))
            headers.append((b"x-request-id", self.request_id.encode()))
            message = {**message, "headers": headers}
        await self.send(message)


async def _torpor_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, TorporError | HTTPProblem):
        return problem_for(exc, request)
    return problem_for(exc, request)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return problem(exc.status_code, _TITLES.get(exc.status_code, "Error"), str(exc.detail),
                   request=request, headers=dict(exc.headers or {}))


async def _client_left(request: Request, exc: Exception) -> Response:
    # The client went away before its body was complete: nothing was done, and it is not
    # the server's fault (no traceback). The answer goes nowhere; the access record shows it.
    log.info("client_left", method=request.method, path=request.url.path)
    return problem(400, "Client Closed Request", "the client left before sending its body",
                   request=request, error="ClientLeft")


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected_error", error=repr(exc), exc_info=exc)
    return problem_for(exc, request)


_TITLES = {404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request"}


def app(
    runtime: Runtime,
    *,
    authorize: Authorize,
    admin_token: str | None = None,
    admin_remote: bool = False,
    admin_allow: Sequence[str] | None = None,
    trusted_proxies: Sequence[str] | None = None,
    metrics: Metrics | None = None,
    shutdown_grace: float = 10.0,
    ping_interval: float = PING_SECONDS,
    page: bool = True,
    cluster_routing: Routing = "proxy",
    ticket_secret: str | bytes | None = None,
    ticket_ttl: float = DEFAULT_TICKET_TTL,
) -> Starlette:
    """The chat API, the admin, ``/metrics`` and the page, over ``runtime``.

    ``authorize(request, conversation_id, action)`` decides who may ``"read"``,
    ``"write"`` or ``"delete"`` which conversation, and ``"list"`` which prefix
    (see :mod:`torpor.serve.access`:
    :func:`bearer_token`, :func:`bearer_tokens`, :func:`allow_all`).
    ``admin_token`` guards ``/admin`` and ``/metrics`` (None: they refuse
    everyone); they answer loopback clients only, unless ``admin_remote`` (any
    client) or ``admin_allow`` (these addresses and networks instead). Behind a
    reverse proxy on the same host every client is a loopback one: name the proxy
    in ``trusted_proxies`` (its ``X-Forwarded-For`` then gives the client's
    address; see :class:`~torpor.serve.access.AdminClients`).

    Server-Sent Events streams that sent nothing for ``ping_interval`` seconds get a
    comment line (a ping), so proxies keep them open.

    Running it: the runtime must be running while the app serves. Either the app's
    own lifespan enters it (when it is not running at startup; it then leaves it at
    shutdown), or the host enters it (``async with rt:`` in its own lifespan) and it
    stays the host's. Mounted in another app (``host.mount("/chat", app(rt, ...))``,
    whose lifespan never reaches mounted apps), the host's lifespan entering the
    runtime is all it takes: the app starts what it runs beside the runtime on its
    first request, and stops it when the runtime leaves. A request that reaches it
    while the runtime is not running is answered 503 with a ``detail`` saying what
    to add.

    Shutdown: new work is refused (503 with ``Retry-After``), turns started over
    HTTP get up to ``shutdown_grace`` seconds to finish, then those still running end
    with a logged ``Aborted("shutdown")`` that their open streams send before they
    close (the app leaves a runtime it entered; in one the host entered, it ends
    those turns the same way and the host leaves the runtime). A turn whose client
    left holds nobody up: it may finish meanwhile, or is aborted with the rest.
    Under ``torpor serve`` (:func:`torpor.serve.serve`) SIGTERM starts this. Under
    plain uvicorn (``uvicorn.run(app)``, or the app mounted in a host), which on
    SIGTERM waits for open connections to close before it runs any lifespan
    shutdown, the app begins draining on the signal itself: it chains the handler
    the server installed (main thread only; the server's own handling follows
    unchanged; see :mod:`torpor.serve.drain`). Keep the server's graceful-shutdown
    timeout (uvicorn's ``--timeout-graceful-shutdown``) above ``shutdown_grace``, or
    unset. Elsewhere, call :func:`drain` when the server begins to stop.

    On a cluster node (``Runtime(node=...)``) a request for a conversation
    another node owns is proxied to it, streams included
    (``cluster_routing="proxy"``, with a client the app's lifespan opens), or
    answered 421 with the owner's address (``"redirect"``, and always without
    the app's lifespan); see :mod:`torpor.serve.proxy`.

    Stream tickets (``POST …/stream-tickets``, for a browser's ``EventSource``; see
    :mod:`torpor.serve.tickets`) last ``ticket_ttl`` seconds and are signed with
    ``ticket_secret`` (at least 16 bytes; None: a random one for this app). Every node
    of a cluster must be given the same secret: a ticket minted on one is checked on
    the conversation's owner.
    """
    if not callable(authorize):
        raise TypeError("authorize must be a callable (request, conversation_id, action)")
    if cluster_routing not in ("proxy", "redirect"):
        raise ValueError(f'cluster_routing must be "proxy" or "redirect", got {cluster_routing!r}')
    clients = AdminClients(allow=admin_allow, trusted_proxies=trusted_proxies,
                           remote=admin_remote)
    metrics = metrics if metrics is not None else Metrics()
    # Every model, tool call, fold and abort of the runtime is measured from here on,
    # whoever enters it (this app's lifespan or the host's own `async with rt:`).
    observe_runtime(runtime, metrics)
    service = Service(runtime, metrics, shutdown_grace=shutdown_grace,
                      ping_interval=ping_interval)
    proxy = Proxy(runtime, cluster_routing)
    tickets = StreamTickets(ticket_secret, ticket_ttl)

    @asynccontextmanager
    async def lifespan(application: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            async with proxy.running():  # closed after the drain: relays end with the runtime
                yield
                await service.shutdown()
        finally:
            await service.shutdown()

    routes: list[BaseRoute] = [
        *schedule_routes(service, authorize, proxy),
        *conversation_routes(service, authorize, proxy),
        *chat_routes(service, authorize, proxy, tickets),
        *ai_sdk_routes(service, authorize, proxy),
        *admin_routes(service, admin_token, clients),
        Route("/healthz", _health(service), methods=["GET"]),
    ]
    if page:
        routes += page_routes()
    handlers: dict[Any, Any] = {
        TorporError: _torpor_error,
        HTTPProblem: _torpor_error,
        HTTPException: _http_error,
        ClientDisconnect: _client_left,  # handled here, not by the 500 handler (no re-raise)
        Exception: _unexpected,
    }
    application = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    application.add_middleware(RequestContext, metrics=metrics)
    application.state.torpor = service
    return application


def _health(service: Service) -> Any:
    async def health(request: Request) -> Response:
        if service.draining or service.stopped:
            return problem(503, "Service Unavailable", "shutting down", request=request,
                           error="Draining", headers={"Retry-After": "5"})
        service.readable()  # 503 until the runtime runs (saying what to add)
        return Response(b'{"ok":true}', media_type="application/json")

    return health


def service_of(application: Starlette) -> Service:
    """The :class:`Service` behind an app made by :func:`app` (drain it, read its state)."""
    service = getattr(application.state, "torpor", None)
    if not isinstance(service, Service):
        raise TypeError("not an app made by torpor.serve.app")
    return service


def drain(application: Starlette, grace: float | None = None) -> asyncio.Task[None]:
    """Begin the graceful shutdown of an app made by :func:`app` now (once; ``grace``
    defaults to its ``shutdown_grace``); await the task for its end. For a server that
    lets its host act when it begins to stop: under uvicorn and ``torpor serve`` the
    app does this itself on SIGTERM."""
    return service_of(application).shutdown(grace)
