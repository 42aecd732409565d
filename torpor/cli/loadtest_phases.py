"""The load test's wall clock: how long each phase took, and one bound on them all.

``--duration`` is the length of the run phase only; building history,
activating every agent, the memory probe and closing the runtime come on top
and grow with ``--agents`` (and with how busy the machine is), so the command
takes longer than ``--duration``. ``--timeout`` bounds the whole command: past
it, the phase under way is cancelled (its task groups cancel their children
and wait for them), the runtime or the HTTP clients close, and the report,
marked ``timed_out``, lists the phases that ran, each with its seconds and
whether it completed. The command then exits 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

__all__ = ["Phases", "default_timeout", "plan_line"]


def default_timeout(duration: float) -> float:
    """The bound when ``--timeout`` is not given: twice the run, plus two minutes.

    Two minutes cover the phases outside the run for the default 10,000 agents
    several times over on two busy cores (about 20 s on an idle machine, see
    the report's ``phases``); twice the run leaves room for its last turns.
    """
    return 120.0 + 2.0 * duration


def plan_line(args: Any, before_run: str) -> str:
    """What will run, said before it runs: ``--duration`` is only the run phase's length."""
    after = ", probe" if getattr(args, "probe_agents", 0) and not getattr(args, "url", None) else ""
    timeout = args.timeout or default_timeout(args.duration)
    return (f"torpor loadtest: {before_run}run ({args.duration:g} s){after}; "
            f"all within --timeout {timeout:g} s")


class Phases:
    """Each phase's duration, and the deadline every bounded phase shares."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._deadline = asyncio.get_running_loop().time() + timeout
        self.records: list[dict[str, Any]] = []
        self.timed_out = False

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Record how long the block took and whether it ended (not cut by the bound)."""
        started, cpu = time.perf_counter(), time.process_time()
        completed = False
        try:
            yield
            completed = True
        finally:
            # CPU seconds (this process, every thread) beside wall seconds: a phase whose
            # wall time far exceeds its CPU time waited (on a busy machine, a server, a lock).
            self.records.append({"name": name,
                                 "seconds": round(time.perf_counter() - started, 3),
                                 "cpu_seconds": round(time.process_time() - cpu, 3),
                                 "completed": completed})

    @asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """Run the block until the shared deadline; past it the block is cancelled (task
        groups inside cancel and await their children), ``timed_out`` is set and the code
        after the block runs: what a timed-out run still owes (closing) is done there.
        A ``TimeoutError`` the deadline did not cause (a socket's) propagates."""
        timeout = asyncio.timeout_at(self._deadline)
        try:
            async with timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise
            self.timed_out = True

    @property
    def interrupted(self) -> str | None:
        """The phase the bound cut, if any."""
        for record in self.records:
            if not record["completed"]:
                return str(record["name"])
        return None

    def report(self) -> dict[str, Any]:
        return {"timeout": self.timeout, "timed_out": self.timed_out,
                "phases": list(self.records)}
