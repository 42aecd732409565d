"""Errors as RFC 9457 ``application/problem+json``, named by their torpor type.

Every failure the HTTP face reports has the same shape: ``type`` (a URN that
names the torpor error), ``title``, ``status``, ``detail``, ``instance`` (the
request path) and two extension members a client can switch on without parsing
prose: ``error`` (the torpor error class, ``Busy``, ``UnknownConversation``…, or
the HTTP layer's own name: ``NotClusterNode``, ``BodyTooLarge``, ``NotFound``…)
and ``request_id``. No problem goes out without an ``error``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from torpor.errors import (
    AgentParked,
    Busy,
    ConfigError,
    ConflictError,
    EventTooLarge,
    IdempotencyConflict,
    InvalidInput,
    NotOwner,
    RuntimeClosed,
    StoreUnavailable,
    TorporError,
    UnknownArtifact,
    UnknownCall,
    UnknownConversation,
)

__all__ = [
    "PROBLEM_JSON",
    "Draining",
    "Forbidden",
    "HTTPProblem",
    "OwnerUnreachable",
    "Unauthorized",
    "error_name",
    "problem",
    "problem_for",
    "status_for",
]

PROBLEM_JSON = "application/problem+json"

RETRY_AFTER_BUSY = 1  # seconds: a mailbox drains as fast as a turn ends
RETRY_AFTER_UNAVAILABLE = 5
RETRY_AFTER_OWNER = 1  # a dead owner's shards move within its lease TTL


class HTTPProblem(Exception):
    """A problem the HTTP layer raises itself (authentication, a malformed body, a route).

    ``error`` names it in the body: a subclass's name by default, else its title
    without spaces (``"Bad Request"``: ``BadRequest``)."""

    status = 400
    title = "Bad Request"

    def __init__(self, detail: str, *, status: int | None = None, title: str | None = None,
                 headers: dict[str, str] | None = None, error: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if title is not None:
            self.title = title
        self.headers = headers or {}
        self.error = error or (
            type(self).__name__ if type(self) is not HTTPProblem else error_name(self.title)
        )


def error_name(title: str) -> str:
    """The ``error`` of a plain HTTP problem: its title in one word (``NotFound``)."""
    return "".join(word[:1].upper() + word[1:] for word in title.split())


class Unauthorized(HTTPProblem):
    """No credentials, or credentials nobody issued: 401 with ``WWW-Authenticate: Bearer``."""

    status = 401
    title = "Unauthorized"

    def __init__(self, detail: str = "a bearer token is required") -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="torpor"'})


class Forbidden(HTTPProblem):
    """Known credentials that may not do this: 403."""

    status = 403
    title = "Forbidden"

    def __init__(self, detail: str = "not allowed") -> None:
        super().__init__(detail)


class Draining(HTTPProblem):
    """The server is shutting down and admits no new work: 503 with ``Retry-After``."""

    status = 503
    title = "Service Unavailable"

    def __init__(self, detail: str = "the server is shutting down") -> None:
        super().__init__(detail, headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE)})


class OwnerUnreachable(HTTPProblem):
    """A cluster node could not reach the node that owns the conversation (it died, or
    its shards are moving): 503 with ``Retry-After``; retry with the same Idempotency-Key."""

    status = 503
    title = "Owner Unreachable"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Retry-After": str(RETRY_AFTER_OWNER)})


# Most specific first: several errors derive from others (IdempotencyConflict is a ValueError).
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (UnknownConversation, 404, "Unknown Conversation"),
    (UnknownCall, 404, "Unknown Call"),
    (UnknownArtifact, 404, "Unknown Artifact"),
    (IdempotencyConflict, 409, "Idempotency Conflict"),
    (ConflictError, 409, "Conflict"),
    (AgentParked, 409, "Agent Parked"),
    (EventTooLarge, 413, "Event Too Large"),
    (InvalidInput, 422, "Invalid Input"),
    (ConfigError, 422, "Invalid Input"),
    (Busy, 429, "Busy"),
    (NotOwner, 421, "Not Owner"),
    (StoreUnavailable, 503, "Store Unavailable"),
    (RuntimeClosed, 503, "Runtime Closed"),
)


def status_for(error: BaseException) -> tuple[int, str]:
    """(HTTP status, title) of a torpor error; 500 for anything not listed."""
    for cls, status, title in _STATUS:
        if isinstance(error, cls):
            return status, title
    return 500, "Internal Server Error"


def _request_id(request: Request | None) -> str | None:
    if request is None:
        return None
    value = getattr(request.state, "request_id", None)
    return value if isinstance(value, str) else None


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    request: Request | None = None,
    error: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Response:
    """The problem response; ``error`` names it (default: the title in one word)."""
    error = error or error_name(title)
    body: dict[str, Any] = {
        "type": f"urn:torpor:error:{error}",
        "title": title,
        "status": status,
        "detail": detail,
    }
    if request is not None:
        body["instance"] = request.url.path
    body["error"] = error
    request_id = _request_id(request)
    if request_id:
        body["request_id"] = request_id
    if extra:
        body.update(extra)
    return Response(msgspec.json.encode(body), status_code=status, media_type=PROBLEM_JSON,
                    headers=headers)


def problem_for(error: BaseException, request: Request | None = None) -> Response:
    """The problem response for an error raised while handling ``request``."""
    if isinstance(error, HTTPProblem):
        return problem(error.status, error.title, error.detail, request=request,
                       error=error.error, headers=error.headers)
    status, title = status_for(error)
    headers: dict[str, str] = {}
    if isinstance(error, Busy):
        headers["Retry-After"] = str(RETRY_AFTER_BUSY)
    elif status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_UNAVAILABLE)
    if status == 500 and not isinstance(error, TorporError):
        detail = "an unexpected error; the server log has the details"
    else:
        detail = str(error)
    name = type(error).__name__ if isinstance(error, TorporError) else "InternalError"
    # Another node of the cluster serves this conversation: where (None: not known yet).
    extra = {"owner": error.owner} if isinstance(error, NotOwner) else None
    return problem(status, title, detail, request=request, error=name, headers=headers,
                   extra=extra)
