"""The model-idle watchdog: one task ends every model stream that stalls, for all agents.

A stream that sends nothing for ``AgentConfig.model_idle_timeout`` seconds ends
its turn with ``ModelTimeout``. A deadline per call (a cancel scope with a timer,
moved on as chunks arrive) cost every call a scope and a timer on the event
loop's heap. Here a call only registers: its agent, its timeout and the clock
reading of its last chunk, which the stream loop refreshes with one store. One
task (owned by the runtime) checks the registered calls every hundredth of the
shortest timeout among them and sleeps on an event while there are none, so a
stalled call ends between 1 and 1.01 times its timeout after its last chunk.

Ending a call cancels the call's own cancel scope (around its stream only,
never the turn's): the call sees its scope's ``cancelled_caught`` and raises
``ModelTimeout``, so the turn ends as a model error (not a cancel). Its own
scope, not the turn's: anyio then tells the watchdog's cancel apart from a
caller's or the runtime's stopping it (which must still stop the turn), and a
late or stray expiry can hit nothing but that stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import anyio

__all__ = ["Call", "ModelWatchdog"]

MIN_TICK = 0.005
"""The shortest pause between checks (a timeout of under half a second)."""


class Call:
    """One model call the watchdog watches; the stream loop stores ``last`` per chunk."""

    __slots__ = ("idle", "last", "scope")

    def __init__(self, scope: anyio.CancelScope, idle: float, now: float) -> None:
        self.scope = scope  # the call's own, around its stream
        self.idle = idle
        self.last = now  # the loop clock at the last chunk (or at the start)


class ModelWatchdog:
    """The registered calls, and the task body that ends the stalled ones."""

    __slots__ = ("_calls", "_loop", "_pause", "_wake")

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pause: float | None = None  # the task's current pause (None: waiting for calls)

    def __len__(self) -> int:
        return len(self._calls)

    def watch(self, scope: anyio.CancelScope, idle: float) -> Call:
        """Register a call starting now, to end by cancelling ``scope`` (the call's own);
        :meth:`release` it when the stream ends."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        call = Call(scope, idle, loop.time())
        self._calls[id(call)] = call
        wake = self._wake
        pause = self._pause
        if wake is not None and (pause is None or idle / 100 < pause):
            wake.set()  # nothing was watched, or this call must be checked sooner
        return call

    def release(self, call: Call) -> None:
        self._calls.pop(id(call), None)

    def check(self, now: float) -> float | None:
        """End the calls stalled at ``now``; the pause until the next check (None: none left)."""
        shortest: float | None = None
        for key, call in list(self._calls.items()):
            if now - call.last >= call.idle:
                del self._calls[key]
                call.scope.cancel()
            elif shortest is None or call.idle < shortest:
                shortest = call.idle
        return None if shortest is None else max(MIN_TICK, shortest / 100)

    async def run(self) -> None:
        """The watchdog's task (the runtime owns it and cancels it when it stops)."""
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        while True:
            wake.clear()
            pause = self._pause = self.check(loop.time())
            if pause is None:
                await wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await wake.wait()
