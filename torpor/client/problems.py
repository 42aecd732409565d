"""The server's problems (RFC 9457 JSON naming a torpor error) raised as torpor's own errors.

A problem whose ``error`` names one of :mod:`torpor.errors`' classes (``Busy``,
``UnknownConversation``, ``AgentParked``, ``InvalidInput``, ``NotOwner``…) is raised
as that class, so code written against an embedded runtime catches the same thing
over HTTP. The HTTP layer's own problems are :class:`HTTPError` and its subclasses
here (:class:`Unauthorized`, :class:`Forbidden`, :class:`Draining`,
:class:`OwnerUnreachable`): ``torpor.serve.problems`` has classes by those names,
but they are the server's (Starlette responses), and this client must not need
Starlette. Either way :func:`problem_of` gives what the server said: status,
``error``, ``detail``, ``Retry-After`` (seconds) and the request id.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torpor import errors
from torpor.errors import TorporError

__all__ = [
    "Draining",
    "EventTooLong",
    "Forbidden",
    "HTTPError",
    "OwnerUnreachable",
    "Problem",
    "ServerUnreachable",
    "Unauthorized",
    "error_for",
    "problem_from",
    "problem_of",
    "retry_after_of",
]


@dataclass(frozen=True, slots=True)
class Problem:
    """What the server answered: its HTTP status, the error's name (``Busy``…), the
    detail, ``Retry-After`` in seconds when given, the request id, the whole body."""

    status: int
    error: str
    detail: str = ""
    retry_after: float | None = None
    request_id: str | None = None
    body: Mapping[str, Any] = field(default_factory=dict)


class HTTPError(TorporError):
    """A problem of the server's HTTP layer (not one of the runtime's errors): a route that
    does not exist, a body too large, an unexpected status."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"HTTP {problem.status} {problem.error}"
                         + (f": {problem.detail}" if problem.detail else ""))
        self.problem = problem

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def retry_after(self) -> float | None:
        return self.problem.retry_after


class Unauthorized(HTTPError):
    """401: no credentials, or ones the server does not know."""


class Forbidden(HTTPError):
    """403: credentials that may not use this conversation (or this ticket's scope)."""


class Draining(HTTPError):
    """503: the server is shutting down and admits no new work; ``retry_after`` says when
    to try again (another instance, or this one restarted)."""


class OwnerUnreachable(HTTPError):
    """503 from a cluster node that could not reach the conversation's owner; retry after
    ``retry_after`` with the same idempotency key."""


class ServerUnreachable(TorporError):
    """The server could not be reached (or kept dropping the connection) through every
    retry; the last network error is the ``__cause__``."""


class EventTooLong(TorporError):
    """A stream sent a line or an event longer than the client's ``max_event_chars``: no
    torpor server does (a proxy's garbage, or a store allowing larger events)."""


_HTTP: dict[str, type[HTTPError]] = {
    "Unauthorized": Unauthorized,
    "Forbidden": Forbidden,
    "Draining": Draining,
    "OwnerUnreachable": OwnerUnreachable,
}


def problem_of(error: BaseException) -> Problem | None:
    """What the server said, for an error this client raised from a server's answer."""
    found = getattr(error, "problem", None)
    return found if isinstance(found, Problem) else None


def retry_after_of(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` as seconds (the delay form; the server never sends a date)."""
    raw = headers.get("retry-after", "").strip()
    try:
        seconds = float(raw)
    except ValueError:
        return None
    return seconds if 0 <= seconds < 1e9 else None


def problem_from(status: int, body: Any, headers: Mapping[str, str]) -> Problem:
    """The problem a response says (a body that is not problem JSON still makes one)."""
    data: Mapping[str, Any] = body if isinstance(body, Mapping) else {}
    error = data.get("error")
    detail = data.get("detail")
    request_id = data.get("request_id") or headers.get("x-request-id")
    return Problem(
        status,
        error if isinstance(error, str) and error else f"HTTP{status}",
        detail if isinstance(detail, str) else "",
        retry_after_of(headers),
        request_id if isinstance(request_id, str) else None,
        data,
    )


def _bare(cls: type[TorporError], detail: str, **attributes: Any) -> TorporError:
    """An instance whose message is the server's own text (its constructor would format
    another) with the attributes the class promises."""
    error = cls.__new__(cls)
    BaseException.__init__(error, detail)
    for name, value in attributes.items():
        setattr(error, name, value)
    return error


def _number(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else None


# The attributes of the runtime's errors that take more than a message, from what the
# request and the problem say (``conversation_id`` and the idempotency ``key`` are ours).
_Fill = Callable[[Problem, "str | None", "str | None"], dict[str, Any]]
_FILL: dict[str, _Fill] = {
    "InvalidInput": lambda p, c, k: {"what": p.detail.partition(":")[0]},
    "ConfigError": lambda p, c, k: {"field": p.detail.partition(":")[0]},
    "AgentParked": lambda p, c, k: {
        "conversation_id": c, "cause": p.detail.partition("is parked: ")[2] or p.detail},
    "IdempotencyConflict": lambda p, c, k: {"conversation_id": c, "key": k},
    "ConflictError": lambda p, c, k: {"conversation_id": c, "expected": None, "actual": None},
    "EventTooLarge": lambda p, c, k: {
        "size": _number(r"of (\d+) bytes exceeds", p.detail),
        "limit": _number(r"limit of (\d+) bytes", p.detail)},
    "UnknownArtifact": lambda p, c, k: {"artifact_id": None},
    "NotOwner": lambda p, c, k: {
        "conversation_id": c, "shard": _number(r"shard (\d+)", p.detail),
        "owner": p.body.get("owner"), "moving": "(in hand-off)" in p.detail},
    "FencedError": lambda p, c, k: {
        "conversation_id": c, "shard": _number(r"shard (\d+)", p.detail), "epoch": None},
    "CorruptEvent": lambda p, c, k: {
        "conversation_id": c, "position": _number(r"position (\d+)", p.detail),
        "detail": p.detail},
}
_FILL["ShardMoved"] = _FILL["NotOwner"]
_FILL["TaskCardTooLarge"] = _FILL["InvalidInput"]


def error_for(problem: Problem, conversation_id: str | None = None,
              key: str | None = None) -> TorporError:
    """The error to raise for ``problem``: the runtime's class it names, else an
    :class:`HTTPError`; :func:`problem_of` gives ``problem`` back from it."""
    name = problem.error
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    error: TorporError
    if isinstance(cls, type) and issubclass(cls, TorporError) and name != "TurnAborted":
        fill = _FILL.get(name)
        if fill is not None:
            error = _bare(cls, problem.detail, **fill(problem, conversation_id, key))
        else:
            try:  # a plain message (Busy, UnknownConversation, StoreUnavailable, ModelError…)
                error = cls(problem.detail)
            except TypeError:  # a class whose constructor wants more: its message only
                error = _bare(cls, problem.detail)
        error.problem = problem  # type: ignore[attr-defined]
        return error
    return _HTTP.get(name, HTTPError)(problem)
