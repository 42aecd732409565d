"""Run an app under uvicorn with torpor's graceful shutdown (what ``torpor serve`` does).

uvicorn on SIGTERM stops accepting and then waits for open connections before
it runs the lifespan shutdown; Server-Sent Events streams never end on their
own, so that wait would last until its timeout and the streams would be cut
without a word. Here SIGTERM (or SIGINT) first drains the service (no new
work, in-flight turns finish up to the grace period, then the runtime stops
and every open stream ends with what the log says happened), and only then
asks uvicorn to exit.

Connections: TCP_NODELAY on every socket (a response is several small writes, which
Nagle's algorithm would hold for the client's delayed ACK, about 40 ms each);
deadlines for a request's headers and body and a cap on open connections
(:mod:`torpor.serve.connections`); uvicorn's keep-alive timeout; warnings and
errors a client can cause rate-limited (:mod:`torpor.serve.loglimit`).

Event loop and HTTP parser (the ``fast`` extra): uvloop and httptools take 18-28% of the
server CPU of an HTTP turn off (bench/serve.py). ``serve`` runs in whatever loop it is
given (:func:`loop_factory` makes uvloop's for ``asyncio.Runner``, which ``torpor
serve`` uses: uvicorn's own ``loop=`` setting applies only when uvicorn starts the loop);
``http`` picks uvicorn's parser, httptools when it is installed unless told.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Generator
from typing import cast

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from torpor._logging import get_logger
from torpor.errors import ConfigError
from torpor.serve.app import service_of
from torpor.serve.connections import ACCEPT_BATCH, Guard, default_connection_limit, guarded
from torpor.serve.loglimit import rate_limited

__all__ = [
    "HTTP_PARSERS",
    "LISTEN_BACKLOG",
    "LOOPS",
    "TIMEOUT_BODY",
    "TIMEOUT_HEADERS",
    "TIMEOUT_KEEP_ALIVE",
    "Server",
    "bind",
    "http_protocol",
    "loop_factory",
    "serve",
]

log = get_logger("torpor.serve")

LISTEN_BACKLOG = 2048
TIMEOUT_KEEP_ALIVE = 5.0  # seconds an idle connection stays open after a response
TIMEOUT_HEADERS = 10.0  # seconds a request's headers may take from its first byte
TIMEOUT_BODY = 30.0  # seconds a request's body may take after its headers


LOOPS = ("auto", "asyncio", "uvloop")
HTTP_PARSERS = ("auto", "h11", "httptools")
_FAST = "pip install 'torpor[fast]'"


def loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What ``asyncio.Runner(loop_factory=...)`` takes for ``choice``: uvloop's loop for
    ``"uvloop"``, and for ``"auto"`` when uvloop is installed; None (asyncio's) otherwise."""
    if choice not in LOOPS:
        raise ConfigError("loop", f"must be one of {', '.join(LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # the fast extra
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("loop", f"uvloop is not installed: {_FAST}") from None
        return None
    return cast("Callable[[], asyncio.AbstractEventLoop]", uvloop.new_event_loop)


def http_protocol(choice: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class for ``choice`` (``"auto"``: httptools when installed)."""
    if choice == "auto":
        return AutoHTTPProtocol
    if choice == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if choice == "httptools":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            raise ConfigError("http", f"httptools is not installed: {_FAST}") from None
        return HttpToolsProtocol
    raise ConfigError("http", f"must be one of {', '.join(HTTP_PARSERS)}, got {choice!r}")


class Server(uvicorn.Server):
    """uvicorn's server without its own signal handling (the runner installs torpor's)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn's backlog is also how many connections asyncio accepts per loop pass
        # (kept small by serve: each batch is admitted, and makes room under the cap,
        # before more are accepted); the kernel's queue of pending connections stays long.
        for sock in sockets or ():
            sock.listen(max(LISTEN_BACKLOG, self.config.backlog))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one; read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on an accepted socket only when its
    # proto says TCP (an accepted socket takes the listening socket's), and Linux hands the
    # listening socket's own TCP_NODELAY down to every connection it accepts.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


async def serve(
    application: Starlette,
    sock: socket.socket,
    *,
    grace: float | None = None,
    signals: bool = True,
    ready: Callable[[], None] | None = None,
    timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE,
    timeout_headers: float = TIMEOUT_HEADERS,
    timeout_body: float = TIMEOUT_BODY,
    limit_connections: int | None = None,
    http: str = "auto",
) -> None:
    """Serve on ``sock`` (already listening: clients may connect before this starts) until
    SIGTERM or SIGINT, then drain (``grace`` seconds for in-flight turns) and return.
    ``ready`` is called once the signals are handled (a "listening" line belongs there).
    ``http``: uvicorn's parser (:func:`http_protocol`), with the deadlines either way.

    A connection idle after a response is closed after ``timeout_keep_alive`` seconds; a
    request's headers must arrive within ``timeout_headers`` of its first byte (of the
    connection, for the first request) and its body within ``timeout_body`` of its
    headers, else the connection is closed (408 when part of the request came).
    ``limit_connections`` caps open connections (None: below the open-file limit, with a
    reserve; 0: no cap): past it a new connection closes the one idle longest, and while
    none is idle requests are answered 503.
    """
    if not timeout_keep_alive > 0:
        raise ValueError(f"timeout_keep_alive must be > 0, got {timeout_keep_alive!r}")
    protocol = http_protocol(http)
    if limit_connections is None:
        limit_connections = default_connection_limit()
    elif limit_connections == 0:
        limit_connections = None
    guard = Guard(timeout_headers=timeout_headers, timeout_body=timeout_body,
                  limit_connections=limit_connections)
    config = uvicorn.Config(
        application, lifespan="on", log_config=None, access_log=False,
        timeout_graceful_shutdown=5, server_header=False,
        # uvicorn's timer takes any number of seconds (loop.call_later)
        timeout_keep_alive=cast(int, timeout_keep_alive),
        http=guarded(protocol, guard), ws="none", backlog=ACCEPT_BATCH,
        # the guard keeps open connections at the cap by closing idle ones; one more means
        # every connection has a request in progress: uvicorn answers 503 (and closes)
        limit_concurrency=None if limit_connections is None else limit_connections + 1,
    )
    server = Server(config)
    service = service_of(application)
    loop = asyncio.get_running_loop()
    stopping: asyncio.Task[None] | None = None

    async def stop() -> None:
        await service.shutdown(grace)
        server.should_exit = True

    def on_signal(signum: signal.Signals) -> None:
        nonlocal stopping
        if stopping is None:
            log.info("draining", signal=signum.name)
            stopping = loop.create_task(stop())
        else:  # a second signal: stop now
            server.force_exit = True
            server.should_exit = True

    installed: list[signal.Signals] = []
    if signals:
        service.drain_on_signal = False  # these handlers drain it (with ``grace``)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
    if ready is not None:
        ready()
    try:
        with rate_limited():
            serving = loop.create_task(server.serve(sockets=[sock]))
            await serving
    finally:
        for installed_signal in installed:
            loop.remove_signal_handler(installed_signal)
        if stopping is not None:
            await stopping
