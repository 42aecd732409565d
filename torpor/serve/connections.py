"""Deadlines and a cap for the connections ``torpor serve`` accepts.

uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``)
but has no deadline for a request's headers or body: a client that connects and
sends nothing, or drips a header byte a second (slowloris), holds its socket for
ever, and enough of them exhaust the process's file descriptors. The protocol made
by :func:`guarded` (uvicorn's own, h11 or httptools, with this mixin in front) adds:

* headers: a request's headers must be complete within ``timeout_headers`` of its
  first byte (of the connection opening, for the first request); else the
  connection is closed (with a 408 when some of the request had arrived);
* body: a request's body must be complete within ``timeout_body`` of its headers;
  else 408 (when the app has not answered yet) and the connection is closed;
* a cap: past ``limit_connections`` open connections, a new one makes room by
  closing the connection that has been idle longest (no request in progress:
  silent, between keep-alive requests, or still sending headers). When every
  connection has a request in progress, uvicorn's ``limit_concurrency`` answers
  503 (and closes) until some finish.

The app's own time (a stream that lasts an hour) is never limited here.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any, ClassVar, cast

from torpor._logging import get_logger

__all__ = ["ACCEPT_BATCH", "Guard", "default_connection_limit", "guarded"]

log = get_logger("torpor.serve")

ACCEPT_BATCH = 64
"""Connections asyncio accepts per loop pass (uvicorn's ``backlog``): each batch is
admitted (and makes room) before the next but one is accepted."""
_RESERVE = 3 * ACCEPT_BATCH + 64  # descriptors kept for batches in flight, the store, logs

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: 16\r\nconnection: close\r\n\r\nrequest timeout\n")


def default_connection_limit() -> int | None:
    """The cap that keeps accepted connections below the open-file limit (None: no limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(soft - max(_RESERVE, soft // 8), 16)


class Guard:
    """One server's deadlines and cap, and its connections that could make room."""

    def __init__(self, *, timeout_headers: float, timeout_body: float,
                 limit_connections: int | None) -> None:
        for name, value in (("timeout_headers", timeout_headers),
                            ("timeout_body", timeout_body)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if limit_connections is not None and limit_connections < 1:
            raise ValueError(f"limit_connections must be >= 1, got {limit_connections!r}")
        self.timeout_headers = timeout_headers
        self.timeout_body = timeout_body
        self.limit_connections = limit_connections
        self.open = 0
        # Connections with no request in progress, longest idle first (dicts keep order).
        self.idle: dict[_Guarded, None] = {}
        self.timed_out = 0
        self.evicted = 0

    def admit(self, newcomer: _Guarded) -> None:
        """Count a new connection; past the cap, close the one idle the longest."""
        self.open += 1
        if self.limit_connections is None or self.open <= self.limit_connections:
            return
        for candidate in self.idle:
            if candidate is not newcomer:
                self.evicted += 1
                log.debug("connection_evicted", open=self.open, limit=self.limit_connections)
                candidate._close(None)
                return


class _Guarded:
    """The mixin; its host class is uvicorn's H11Protocol or HttpToolsProtocol."""

    guard: ClassVar[Guard]
    # uvicorn's protocol attributes this relies on (both implementations have them)
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop
    connections: set[Any]  # uvicorn's open connections, which limit_concurrency counts

    # Slots, not attributes: added to uvicorn's protocol, in an order that varies with
    # what the connection does, they turned its instance dict from a shared-key table into
    # one of its own (272 -> 1,584 bytes per connection).
    __slots__ = ("_body_of", "_counted", "_deadline", "_partial")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._body_of: Any = None  # the request whose body the deadline is for
        self._partial = False  # bytes of a request arrived since the last response
        self._counted = False
        super().connection_made(transport)  # type: ignore[misc]
        guard = self.guard
        self._counted = True
        guard.idle[self] = None
        self._arm(guard.timeout_headers, "headers")
        guard.admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if not self._busy():
            self._partial = True
            if self._deadline is None:  # a next request begins: its headers have a deadline
                self._arm(self.guard.timeout_headers, "headers")
        super().data_received(data)  # type: ignore[misc]
        self._update()

    def on_response_complete(self) -> None:
        self._partial = False
        super().on_response_complete()  # type: ignore[misc]
        self._update()

    # -- state -------------------------------------------------------------------------
    def _busy(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _update(self) -> None:
        if self.transport.is_closing():
            self._forget()
            return
        idle = self.guard.idle
        if not self._busy():  # uvicorn's keep-alive timer, or our headers deadline, runs
            if self not in idle:
                idle[self] = None
            return
        self._partial = False
        idle.pop(self, None)
        cycle = self.cycle
        if cycle.more_body:
            if self._body_of is not cycle:
                self._body_of = cycle
                self._arm(self.guard.timeout_body, "body")
        else:
            self._disarm()

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _forget(self) -> None:
        self._disarm()
        guard = self.guard
        guard.idle.pop(self, None)
        if self._counted:
            self._counted = False
            guard.open -= 1

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.timed_out += 1
        # body: a 408 unless the app answered already; headers: a partial request gets a
        # 408, a connection that sent nothing no answer
        answer = not self.cycle.response_started if phase == "body" else self._partial
        log.debug("request_timeout", phase=phase)
        self._close(_TIMEOUT_408 if answer else None)

    def _close(self, answer: bytes | None) -> None:
        self._forget()
        if answer is not None:
            self.transport.write(answer)
        self.transport.close()
        # uvicorn counts a connection until its loss is delivered, which uvloop does a loop
        # pass later than asyncio: a request arriving meanwhile would get 503 for it.
        self.connections.discard(self)


def guarded(base: type[asyncio.Protocol], guard: Guard) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with ``guard``'s deadlines and cap."""
    return cast("type[asyncio.Protocol]",
                type(f"Guarded{base.__name__}", (_Guarded, base), {"guard": guard}))
