"""Streaming routes run above Starlette's routing layers, so an open stream holds none of them.

A request is handled inside a stack of coroutines: the middleware, the router,
the route, Starlette's two exception wrappers, each with its frame and closures
(about 4 KB). A short request gives them back at once; a Server-Sent Events
stream would hold them as long as it is open, and so would every request still
waiting on the store when thousands of followers connect at once. A route whose
endpoint is :class:`Deferred` instead leaves its handler in a slot the request
middleware put in the scope (:data:`DEFER`) and returns; the middleware runs it
once the routing layers have returned (:func:`deferred`, then
:meth:`Deferred.respond` and the response), with the app's exception handlers, as
Starlette would have.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["DEFER", "Deferred", "deferred"]

DEFER = "torpor.deferred"  # a scope key: the list a Deferred endpoint puts itself in

Handler = Callable[[Request], Awaitable[Response]]


class Deferred:
    """A route's ASGI endpoint: ``handler(request)`` and its response, run by the request
    middleware after the routing layers have returned (in place when there is none)."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        later = scope.get(DEFER)
        if later is not None and not later:
            later.append(self)  # nothing sent: the layers below see a quiet return
            return
        response = await self.respond(scope, receive, send)
        await response(scope, receive, send)

    async def respond(self, scope: Scope, receive: Receive, send: Send) -> Response:
        """The handler's response, or the one the app's exception handlers give."""
        request = Request(scope, receive, send)
        try:
            return await self.handler(request)
        except Exception as exc:
            handler = _handler_for(scope, exc)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
            return response  # type: ignore[no-any-return]


def deferred(later: list[Deferred], scope: Scope) -> Deferred | None:
    """What a Deferred endpoint left in ``later`` (the middleware's slot), if anything."""
    scope.pop(DEFER, None)
    return later.pop() if later else None


def _handler_for(scope: Scope, exc: Exception) -> Any:
    """The app's handler for ``exc``, looked up as Starlette's exception middleware does
    (it leaves its handlers in the scope)."""
    handlers, by_status = scope.get("starlette.exception_handlers", ({}, {}))
    if isinstance(exc, HTTPException) and exc.status_code in by_status:
        return by_status[exc.status_code]
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
