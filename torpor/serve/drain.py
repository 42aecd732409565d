"""Draining under a server that is not ``torpor serve``: seeing its SIGTERM, and the wait.

uvicorn (0.54) on SIGTERM or SIGINT stops accepting, tells each connection to close
after its response, and waits for every connection to close before it runs the
lifespan shutdown; an in-flight request is told nothing (``receive()`` does not
return ``http.disconnect`` for it). A Server-Sent Events stream never ends on its
own, so without a hint the server waits for ever (or cuts it at
``--timeout-graceful-shutdown``, without a word), and a drain started from the
lifespan shutdown comes too late. So the app learns of the signal itself:
:class:`SignalDrain` chains the signal handler the server installed (it calls it
after beginning the drain, so the server does exactly what it did before) and
removes itself when the runtime leaves. It is installed only on the main thread,
and only over a handler written in Python (a server's, like uvicorn's
``handle_exit``): never over the default handlers, so a process that did not handle
SIGTERM still dies of it.

:func:`wait_for_turns` is the drain's wait: it waits for the turns started over HTTP up
to the grace, except those whose client has left (their stream ended because the
client went away: nobody sees their end live, and it is logged either way), which
hold nobody up.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from torpor.actors.turn import Turn

__all__ = ["SignalDrain", "wait_for_turns"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalDrain:
    """``begin()`` on SIGTERM/SIGINT, then the handler that was there before."""

    __slots__ = ("_begin", "_loop", "_previous")

    def __init__(self, begin: Callable[[str], None]) -> None:
        self._begin = begin
        self._loop = asyncio.get_running_loop()
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Chain the handlers a server installed (main thread only); True if any."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if not callable(previous) or previous is signal.default_int_handler:
                continue  # not a server's: the process keeps its default behaviour
            signal.signal(signum, self._handle)
            self._previous[signum] = previous
        return bool(self._previous)

    def uninstall(self) -> None:
        """Put the earlier handlers back (where nobody chained over ours since)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to drain
            self._loop.call_soon_threadsafe(self._begin, signal.Signals(signum).name)
        if previous is not None:
            previous(signum, frame)


async def wait_for_turns(turns: list[Turn], left: set[Turn], grace: float,
                         wake: Callable[[], asyncio.Future[None]]) -> list[Turn]:
    """Wait until every turn in ``turns`` has ended or is in ``left``, at most ``grace``
    seconds; ``wake()`` gives a future completed when ``left`` grows. Returns the turns
    still running at the deadline that were waited for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    # Cancelling a wait for a turn's result cancels the wait only, never the turn.
    waits = {turn: asyncio.ensure_future(turn.result()) for turn in turns}
    try:
        while True:
            waited = [w for t, w in waits.items() if not w.done() and t not in left]
            remaining = deadline - loop.time()
            if not waited or remaining <= 0:
                return [t for t, w in waits.items() if not w.done() and t not in left]
            woken = wake()
            futures: list[asyncio.Future[Any]] = [*waited, woken]
            await asyncio.wait(futures, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
    finally:
        for wait in waits.values():
            if not wait.done():
                wait.cancel()
            elif not wait.cancelled():
                wait.exception()  # an aborted turn was the stream's to report
