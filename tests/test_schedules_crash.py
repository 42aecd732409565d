"""kill -9 around a firing: a process killed just before its firing commits, or just after
(its message logged, its turn not answered), loses nothing and doubles nothing: the next
runtime fires the first once (and answers it), and never fires the second again (its turn
ends as any turn its process died in: ``Aborted(interrupted)``, re-driven at start-up).

The killed process announces the point on stdout (the synchronisation), then waits; the
test SIGKILLs it there. Its store's ``append_events`` is wrapped to stop at that point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from torpor import Aborted, AssistantMessage, Event, Runtime, RuntimeConfig, UserMessage

T0 = 1_800_000_000.0

KILLED = textwrap.dedent(
    """
    import sys, anyio, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import Runtime, RuntimeConfig

    now = [1_800_000_000.0]
    point = sys.argv[2]

    async def main() -> None:
        never = anyio.Event()
        async with Runtime(sys.argv[1], config=RuntimeConfig(clock=lambda: now[0])) as rt:
            await (await rt.send("c", "hi")).result()
            store = rt.store
            real = store.append_events

            async def stopping(*args, **kw):
                if kw.get("fired") is None:
                    return await real(*args, **kw)
                if point == "before":
                    print("firing", flush=True)
                    await never.wait()
                events = await real(*args, **kw)
                print("fired", flush=True)
                await never.wait()

            store.append_events = stopping
            await rt.schedule("c", "wake up", after=5)
            now[0] += 5
            rt._scheduler.poke()
            await never.wait()

    anyio.run(main)
    """
)


def run_until_then_kill(url: str, point: str) -> None:
    """Blocking on purpose: the process's line is the synchronisation point, then SIGKILL."""
    process = subprocess.Popen([sys.executable, "-c", KILLED, url, point],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line == ("firing" if point == "before" else "fired")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def scheduled(events: list[Event]) -> list[str]:
    return [e.body.text for e in events
            if isinstance(e.body, UserMessage) and e.body.scheduled is not None]


@pytest.mark.parametrize("point", ["before", "after"])
async def test_killed_around_a_firing_no_loss_no_double(tmp_path: Path, point: str) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    run_until_then_kill(url, point)
    async with Runtime(url) as rt:  # the same store, before any new runtime fires
        log = await rt.store.read_since("c", 0)
        pending = await rt.schedules("c")
    if point == "before":
        assert scheduled(log) == [] and len(pending) == 1  # not fired: still due
    else:
        assert scheduled(log) == ["wake up"] and pending == []  # fired: moved with it
    clock = RuntimeConfig(clock=lambda: T0 + 60)
    async with Runtime(url, config=clock) as rt:
        ended = AssistantMessage if point == "before" else Aborted
        with anyio.fail_after(20):  # the firing is answered (before); the owed turn ends
            async with rt.subscribe("c", after=0) as follower:
                async for item in follower:
                    if (isinstance(item, Event) and isinstance(item.body, ended)
                            and item.turn == 2):
                        break
        log = await rt.store.read_since("c", 0)
        assert scheduled(log) == ["wake up"]  # once
        assert await rt.schedules("c") == []
    async with Runtime(url, config=clock) as rt:  # and never again
        assert scheduled(await rt.store.read_since("c", 0)) == ["wake up"]
