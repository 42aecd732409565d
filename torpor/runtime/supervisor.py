"""The supervisor: owns every agent task, restarts crashed agents, parks crash loops.

An agent task is a bare asyncio task (an anyio task-group child costs ~8 KB;
a bare task ~1 KB), so ownership is explicit instead: every task is in
``tasks`` until it ends, and ``stop()`` cancels and awaits all of them. A
crash restarts the agent from the log after an exponential backoff; more than
``max_restarts`` crashes within ``restart_window`` parks it, durably.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import anyio

from torpor.actors.actor import run_agent
from torpor.actors.mailbox import SendRequest
from torpor.actors.state import AgentState
from torpor.errors import AgentParked, TurnAborted
from torpor.events import Parked

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.host import Runtime

__all__ = ["Supervisor"]


class Supervisor:
    __slots__ = ("_rt", "stopping", "tasks")

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False

    def ensure_running(self, agent: Agent, *, delay: float = 0.0) -> None:
        """Give the agent a task if it has none (a hibernated or new agent has none)."""
        if agent.task is not None or self.stopping:
            return
        task = asyncio.get_running_loop().create_task(self._supervise(agent, delay))
        agent.task = task
        self.tasks.add(task)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A short supervisor job (parking); owned here like the agents."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _supervise(self, agent: Agent, delay: float) -> None:
        # Bookkeeping happens inside the task, not in a done callback, so by the time
        # anyone can observe the task as finished, the registry already says so.
        task = asyncio.current_task()
        crash: Exception | None = None
        try:
            await run_agent(agent, self._rt, delay=delay)
        except Exception as exc:
            crash = exc
        finally:
            self.tasks.discard(task)
            if agent.task is task:
                agent.task = None
        if crash is not None:
            self._crashed(agent, crash)
        elif agent.mailbox_depth() and not self.stopping and agent.state is not AgentState.PARKED:
            self.ensure_running(agent)  # a message arrived as it hibernated

    def _crashed(self, agent: Agent, exc: BaseException) -> None:
        rt = self._rt
        rt.counters.crashes += 1
        cause = f"{type(exc).__name__}: {exc}"
        agent.last_error = cause
        rt.log.warning("agent crashed", conversation_id=agent.id, error=cause, exc_info=exc)
        error = TurnAborted("crashed", "", cause)
        if agent.current is not None:
            agent.current._fail(error)
            agent.current = None
        if agent.hub is not None:
            agent.hub.close(error)
            agent.hub = None
        agent.scope = None
        agent.ws = None  # the log is the memory: the restart reads it back
        rt.forget_bytes(agent)
        if self.stopping:
            return
        now = time.monotonic()
        window = rt.config.restart_window
        agent.crash_times = (*(t for t in agent.crash_times if now - t < window), now)
        if len(agent.crash_times) > rt.config.max_restarts:
            self.spawn(self._park(agent, cause))
            return
        agent.restarts += 1
        rt.counters.restarts += 1
        n = len(agent.crash_times)
        delay = min(rt.config.backoff_max, rt.config.backoff_initial * 2 ** (n - 1))
        rt.transition(agent, agent.state, AgentState.REVIVING)
        agent.state = AgentState.REVIVING
        self.ensure_running(agent, delay=delay)

    async def _park(self, agent: Agent, cause: str) -> None:
        rt = self._rt
        rt.counters.parks += 1
        old = agent.state
        agent.state = AgentState.PARKED  # refuse input from now on
        agent.parked_cause = cause
        rt.registry.unqueue(agent)
        error = AgentParked(agent.id, cause)
        mailbox = agent.mailbox
        agent.mailbox = None
        if mailbox is not None:
            for message in mailbox.drain():
                future = message.accepted if isinstance(message, SendRequest) else message.done
                if not future.done():
                    future.set_exception(error)
        try:
            with anyio.CancelScope(shield=True):
                await rt.store.append_events(
                    agent.id, [Parked(cause, restarts=agent.restarts)], turn=agent.turn
                )
        except Exception as exc:  # the store may be what keeps failing: stay parked in memory
            rt.log.error("could not log parking", conversation_id=agent.id, error=repr(exc))
        rt.log.error("agent parked", conversation_id=agent.id, cause=cause,
                     restarts=agent.restarts)
        rt.transition(agent, old, AgentState.PARKED)  # announced once it is in the log

    async def stop(self) -> None:
        """Cancel every agent task and wait for each to log how its turn ended."""
        self.stopping = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
