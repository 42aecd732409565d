"""The served runtime: who owns its lifespan, admission while draining, in-flight turns.

The app owns the runtime when it was not running when the app started (then
the app's lifespan enters and leaves it); otherwise the host that entered it
owns it. Graceful shutdown (:meth:`Service.shutdown`): stop admitting new
work (503 with ``Retry-After``), let the turns started over HTTP finish up to
a deadline, then stop the runtime, whose leaving ends every in-flight turn
with an ``Aborted("shutdown")`` that the log holds and the open streams send
(a runtime the host entered is not left: its turns still running at the deadline are
ended the same way, and the host leaves it). A turn whose client has left holds
nobody up (see :mod:`torpor.serve.drain`).
A cluster node instead begins leaving the cluster at once: its shards move to
the other nodes as their turns end, and requests that still reach it are
proxied to the new owners rather than refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from torpor._logging import get_logger
from torpor.actors.turn import Turn
from torpor.errors import RuntimeClosed
from torpor.runtime import Runtime
from torpor.serve.drain import SignalDrain, wait_for_turns
from torpor.serve.metrics import Metrics
from torpor.serve.problems import Draining
from torpor.serve.sse_response import PING_SECONDS, Streams

__all__ = ["Service"]

log = get_logger("torpor.serve")


def rss_bytes() -> int | None:
    """This process's resident set size (Linux), None where /proc is not there."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRUNE_AT = 64  # tracked turns before the ended ones are dropped (then twice those running)


NOT_ENTERED = (
    "the runtime is not running: enter it in your app's lifespan (`async with rt: yield`), "
    "or run the torpor app's own lifespan from yours "
    "(`async with chat.router.lifespan_context(chat): yield`)"
)


def _running(rt: Runtime) -> bool:
    try:
        rt.store  # noqa: B018 - raises RuntimeClosed unless the runtime is entered
    except RuntimeClosed:
        return False
    return True


class Service:
    """One served runtime and the state of the HTTP face around it."""

    def __init__(self, runtime: Runtime, metrics: Metrics, *, shutdown_grace: float,
                 ping_interval: float = PING_SECONDS) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.shutdown_grace = shutdown_grace
        self.owns_runtime = False
        self.draining = False
        self.departing = False  # a cluster node draining: its shards move to the others
        self.stopped = False
        self.started_at = time.time()
        # Turns started over HTTP: no task per turn to learn of its end, its done() is
        # enough (ended ones are dropped as the set grows, and skipped when read).
        self._inflight: set[Turn] = set()
        self._prune_at = _PRUNE_AT
        # the open Server-Sent Events streams, and the one timer that pings the idle ones
        self.streams = Streams(ping_interval)
        # read when scraped, not set twice per stream
        metrics.open_streams.set_function(lambda: len(self.streams))
        self._watch: asyncio.Task[None] | None = None
        self._shutdown: asyncio.Task[None] | None = None
        # Under a server that handles SIGTERM itself (plain uvicorn): its signal begins the
        # drain (torpor serve's runner drains on the signal itself and turns this off).
        self.drain_on_signal = True
        self._signals: SignalDrain | None = None
        # turns whose client left (their stream ended): the drain does not wait for them
        self._left: set[Turn] = set()
        self._left_wake: asyncio.Future[None] | None = None

    # -- lifespan ------------------------------------------------------------------------
    async def start(self) -> None:
        """Enter the runtime unless someone else runs it; start the lifecycle watch."""
        if not _running(self.runtime):
            await self.runtime.__aenter__()
            self.owns_runtime = True
        self.ensure_started()
        log.info("serving", owns_runtime=self.owns_runtime)

    def ensure_started(self) -> None:
        """Start what runs while the runtime runs: the lifecycle watch (which ends when the
        runtime leaves, or when this service stops) and the drain on the server's signal.
        A mounted app that no lifespan started gets it from its first request."""
        if self._watch is None and not self.stopped and _running(self.runtime):
            self._watch = asyncio.get_running_loop().create_task(
                self._follow_lifecycle(), name="torpor-serve-watch"
            )
            self.metrics.tap.install()  # group-commit metrics, until the service stops
            if self.drain_on_signal:
                signals = SignalDrain(self._on_signal)
                if signals.install():
                    self._signals = signals

    async def _follow_lifecycle(self) -> None:
        clock = self.metrics.clock
        try:
            with self.runtime.admin.watch() as watcher:
                async for transition in watcher:
                    clock.observe(transition)
        finally:  # the runtime left (or the service stopped): no drain on a signal now
            signals, self._signals = self._signals, None
            if signals is not None:
                signals.uninstall()
            self.metrics.tap.uninstall()  # nothing to tap until the runtime runs again
            if self._watch is asyncio.current_task():
                self._watch = None  # entered again, the next request starts it again

    def _on_signal(self, name: str) -> None:
        if self._shutdown is None and not self.stopped:
            log.info("draining", signal=name)
            self.shutdown()

    def client_left(self, turn: Turn) -> None:
        """The client of ``turn``'s stream went away: a drain need not wait for it."""
        if not turn.done():
            self._left.add(turn)
            wake = self._left_wake
            if wake is not None and not wake.done():
                wake.set_result(None)

    def _left_grows(self) -> asyncio.Future[None]:
        self._left_wake = asyncio.get_running_loop().create_future()
        return self._left_wake

    def shutdown(self, grace: float | None = None) -> asyncio.Task[None]:
        """Begin graceful shutdown (once); await the returned task for its end."""
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(
                self._drain_and_stop(self.shutdown_grace if grace is None else grace)
            )
        return self._shutdown

    async def _drain_and_stop(self, grace: float) -> None:
        self.draining = True
        if _running(self.runtime):
            # A cluster node hands its shards off while it drains: requests for them wait
            # for their new owners and are proxied there instead of refused.
            self.departing = await self.runtime.admin.depart(grace)
        pending = [t for t in self._inflight if not t.done()]
        log.info("draining", turns_in_flight=len(pending), grace_seconds=grace)
        self.streams.watch_clients()  # a client that left lets its turn go at once
        if pending:
            late = await wait_for_turns(pending, self._left, grace, self._left_grows)
            if late:
                log.warning("turns_aborted_at_deadline", turns=len(late))
        if self.owns_runtime:
            with contextlib.suppress(RuntimeClosed):
                await self.runtime.__aexit__(None, None, None)
        elif (not self.departing and _running(self.runtime)
              and any(not t.done() for t in self._inflight)):
            # The host's runtime stays entered, but its turns still running end now as
            # leaving would end them, so the streams below send their Aborted("shutdown")
            # (a server such as uvicorn leaves the host's lifespan only once they closed).
            with contextlib.suppress(RuntimeClosed):
                await self.runtime.admin.stop_turns()
        # Each stream sends what its follower holds (the Aborted("shutdown") of a turn
        # the runtime's leaving ended) and then ends.
        self.streams.stop_all()
        self.stopped = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        self.metrics.detach()  # the loggers untapped, the runtime's metrics observer removed
        log.info("stopped")

    # -- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        """Refuse new work while draining (503); refuse everything once the runtime is gone."""
        if self.stopped or (self.draining and not self.departing):
            raise Draining()
        if not _running(self.runtime):
            raise RuntimeClosed(NOT_ENTERED)
        self.ensure_started()

    def readable(self) -> None:
        if self.stopped:
            raise RuntimeClosed("the runtime is not running (the server stopped)")
        if not _running(self.runtime):
            raise RuntimeClosed(NOT_ENTERED)
        self.ensure_started()

    def track(self, turn: Turn) -> bool:
        """Remember a turn started over HTTP until it ends (shutdown lets it finish).

        True when an earlier request was handed this very turn, still running: this one
        is a keyed retry that joined it (the runtime hands a turn out once otherwise)."""
        inflight = self._inflight
        if turn in inflight:
            return not turn.done()
        if turn.done():
            return False
        if len(inflight) >= self._prune_at:  # amortised O(1) per turn
            self._inflight = inflight = {t for t in inflight if not t.done()}
            self._left = {t for t in self._left if not t.done()}
            self._prune_at = max(_PRUNE_AT, 2 * len(inflight))
        inflight.add(turn)
        return False

    @property
    def turns_in_flight(self) -> int:
        return sum(not turn.done() for turn in self._inflight)

    def server_stats(self) -> dict[str, Any]:
        return {
            "rss_bytes": rss_bytes(),
            "uptime_seconds": round(time.time() - self.started_at, 3),
            "open_streams": len(self.streams),
            "turns_in_flight": self.turns_in_flight,
            "draining": self.draining,
            **self.metrics.clock.summary(),
        }
