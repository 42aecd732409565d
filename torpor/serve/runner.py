"""Run an app under uvicorn with torpor's graceful shutdown (what ``torpor serve`` does).

uvicorn on SIGTERM stops accepting and then waits for open connections before
it runs the lifespan shutdown; Server-Sent Events streams never end on their
own, so that wait would last until its timeout and the streams would be cut
without a word. Here SIGTERM (or SIGINT) first drains the service (no new
work, in-flight turns finish up to the grace period, then the runtime stops
and every open stream ends with what the log says happened), and only then
asks uvicorn to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Generator

import uvicorn
from starlette.applications import Starlette

from torpor._logging import get_logger
from torpor.serve.app import service_of

__all__ = ["Server", "bind", "serve"]

log = get_logger("torpor.serve")


class Server(uvicorn.Server):
    """uvicorn's server without its own signal handling (the runner installs torpor's)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one; read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(
    application: Starlette,
    sock: socket.socket,
    *,
    grace: float | None = None,
    signals: bool = True,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve on ``sock`` (already listening: clients may connect before this starts) until
    SIGTERM or SIGINT, then drain (``grace`` seconds for in-flight turns) and return.
    ``ready`` is called once the signals are handled (a "listening" line belongs there)."""
    config = uvicorn.Config(
        application, lifespan="on", log_config=None, access_log=False,
        timeout_graceful_shutdown=5, timeout_keep_alive=5, server_header=False,
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
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
    if ready is not None:
        ready()
    serving = loop.create_task(server.serve(sockets=[sock]))
    try:
        await serving
    finally:
        for installed_signal in installed:
            loop.remove_signal_handler(installed_signal)
        if stopping is not None:
            await stopping
