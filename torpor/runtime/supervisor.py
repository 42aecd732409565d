"""The supervisor: owns every agent task, restarts crashed agents, parks crash loops.

An agent task is a bare asyncio task (an anyio task-group child costs ~8 KB;
a bare task ~1 KB), so ownership is explicit instead: every task is in
``tasks`` until it ends, and ``stop()`` cancels and awaits all of them, up to
the shutdown deadline. A crash restarts the agent from the log after an
exponential backoff; more than ``max_restarts`` crashes within
``restart_window`` parks it, durably.

A store that cannot write is not the agent's fault: ``StoreUnavailable``
stops the turn (its callers get the error, nothing partial is logged) and the
agent retries on the same backoff until the store writes again, without
counting towards parking. A log that does not read back (``CorruptEvent`` on
revival) is no crash either, and no restart can help: its callers get the
error and the agent is forgotten, neither restarted nor parked.

Nothing here may raise out of a supervising task: a failure while handling a
failure (a log handler that chokes, say) still completes every waiting
caller and leaves the agent restartable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from torpor.actors.actor import Recovery, run_agent
from torpor.actors.mailbox import StopRequest
from torpor.actors.state import AgentState
from torpor.errors import (
    CorruptEvent,
    FencedError,
    RuntimeClosed,
    StoreUnavailable,
    TurnAborted,
)

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters

__all__ = ["Supervisor"]


class Supervisor:
    """Owns the agents' tasks; decides how an agent's next task starts after one ends.

    It never writes an agent's fields: the next task does, from the
    :class:`~torpor.actors.actor.Recovery` it is given (fail the open turn's
    waiters, drop the caches, park), before anything else.
    """

    __slots__ = ("_config", "_counters", "_host", "_log", "_registry", "retired", "stopping",
                 "tasks")

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        host: AgentHost,
        log: Any,
    ) -> None:
        self._config = config
        self._registry = registry
        self._counters = counters
        self._host = host
        self._log = log
        self.tasks: set[asyncio.Task[Any]] = set()
        self.retired: set[Agent] = set()  # taken out of the runtime (its shard moved)
        self.stopping = False

    def retire(self, agent: Agent, error: BaseException) -> asyncio.Task[None] | None:
        """Stop the agent for good (its conversation moved away): whatever waits on it
        fails with ``error``, done by its own task (a last one if it had none), which is
        not restarted; returns that task."""
        if agent.task is None:
            self.ensure_running(agent, recovery=Recovery(error, final=True))
        else:
            self.retired.add(agent)
            agent.post(StopRequest(error))
            agent.task.cancel()
        return agent.task

    def ensure_running(
        self, agent: Agent, *, delay: float = 0.0, recovery: Recovery | None = None
    ) -> None:
        """Give the agent a task if it has none (a hibernated or new agent has none)."""
        if agent.task is not None:
            return
        if self.stopping:
            recovery = Recovery(RuntimeClosed("the runtime is stopping"), final=True)
            delay = 0.0
        task = asyncio.get_running_loop().create_task(self._supervise(agent, delay, recovery))
        agent.task = task
        self.tasks.add(task)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A short supervisor job; owned here like the agents."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _supervise(self, agent: Agent, delay: float, recovery: Recovery | None) -> None:
        # Bookkeeping happens inside the task, not in a done callback, so by the time
        # anyone can observe the task as finished, the registry already says so.
        task = asyncio.current_task()
        crash: Exception | None = None
        try:
            await run_agent(agent, self._host, delay=delay, recovery=recovery)
        except Exception as exc:
            crash = exc
        finally:
            self.tasks.discard(task)
            if not self.tasks:  # a set never shrinks: after a storm its table would stay
                self.tasks = set()
            if agent.task is task:
                agent.task = None
            retired = agent in self.retired
            self.retired.discard(agent)
        if retired or (recovery is not None and recovery.final):
            return  # its shard moved to another node, which serves it from the log
        try:
            self._next(agent, crash)
        except Exception as exc:  # handling a failure failed: keep every promise anyway
            _log(self._log, "error", "supervisor_failed", conversation_id=agent.id,
                 error=repr(exc))
            if not self.stopping and agent.task is None:
                error = TurnAborted("crashed", "", f"{type(exc).__name__}: {exc}")
                self.ensure_running(agent, delay=self._config.backoff_max,
                                    recovery=Recovery(error, drain=True))

    def _next(self, agent: Agent, crash: Exception | None) -> None:
        """How the agent goes on after its task ended (``crash``: how it failed)."""
        if crash is None:
            if self.stopping or agent.state is AgentState.PARKED:
                return
            if agent.has_work() or agent.runnable_postponed():
                self.ensure_running(agent)  # a message arrived as it hibernated
            elif agent.ws is None:
                self._registry.rest(agent.id)  # hibernated: dormant once this task ends
            return
        if self.stopping:
            self.ensure_running(
                agent, recovery=Recovery(RuntimeClosed("the runtime stopped"), final=True)
            )
        elif self._registry.get(agent.id) is not agent:  # evicted as its turn ended
            self.ensure_running(agent, recovery=Recovery(crash, final=True))
        elif isinstance(crash, FencedError):
            self._forget(agent, crash, "conversation fenced; dropped")
        elif isinstance(crash, StoreUnavailable):
            self._store_down(agent, crash)
        elif isinstance(crash, CorruptEvent) and agent.ws is None:
            self._unreadable(agent, crash)  # its revival could not read the log back
        else:
            self._crashed(agent, crash)

    def _store_refused(
        self, agent: Agent, exc: StoreUnavailable, what: str, level: str = "warning"
    ) -> None:
        """Counted as the store's failure, never as the agent's crash."""
        self._counters.store_failures += 1
        _log(self._log, level, what, conversation_id=agent.id, error=str(exc))

    def _store_down(self, agent: Agent, exc: StoreUnavailable) -> None:
        """Retry until the store writes again, on a backoff that does not count as crashes:
        the log may owe an Aborted for the turn, and postponed turns wait to run."""
        failures = agent.store_failures + 1
        # One warning per agent and episode: every retry the store refuses again (each
        # send cuts the backoff short) is counted, and logged at debug only.
        self._store_refused(agent, exc, "store unavailable; retrying",
                            "warning" if failures == 1 else "debug")
        delay = min(
            self._config.backoff_max, self._config.backoff_initial * 2 ** (failures - 1)
        )
        self.ensure_running(agent, delay=delay, recovery=Recovery(exc, drain=True))

    def _forget(self, agent: Agent, exc: Exception, what: str) -> None:
        """Fail everything waiting on the agent with ``exc`` and drop it from the runtime.

        Fenced: this node may no longer write the conversation (another node holds
        its shard), and retrying would be refused the same way forever; the shard's
        owner serves it from the log (postponed turns included).
        """
        if isinstance(exc, StoreUnavailable):
            self._store_refused(agent, exc, what)
        if self._registry.get(agent.id) is agent:
            self._registry.remove(agent)
        self.ensure_running(agent, recovery=Recovery(exc, final=True))

    def _unreadable(self, agent: Agent, exc: CorruptEvent) -> None:
        """The log does not read back (a hole, a row that does not decode).

        No restart can change that, and it is not the conversation's model or
        tools failing: no crash loop and no parking. Every waiting caller gets
        the CorruptEvent (naming the position) and the agent is forgotten, so
        the next request reads the log again, and fails the same way until the
        log is repaired.
        """
        _log(self._log, "error", "conversation_log_unreadable", conversation_id=agent.id,
             error=str(exc))
        self._forget(agent, exc, "conversation log unreadable")

    def _crashed(self, agent: Agent, exc: BaseException) -> None:
        self._counters.crashes += 1
        cause = f"{type(exc).__name__}: {exc}"
        _log(self._log, "warning", "agent_crashed", conversation_id=agent.id, error=cause,
             exc_info=exc)
        error = TurnAborted("crashed", "", cause)
        now = time.monotonic()
        window = self._config.restart_window
        crashes = sum(1 for t in agent.crash_times if now - t < window) + 1
        if crashes > self._config.max_restarts:
            self._counters.parks += 1
            self._registry.unqueue(agent)
            self.ensure_running(agent, recovery=Recovery(error, park=cause, crash=now))
            return
        self._counters.restarts += 1
        delay = min(self._config.backoff_max, self._config.backoff_initial * 2 ** (crashes - 1))
        self.ensure_running(agent, delay=delay, recovery=Recovery(error, crash=now))

    async def stop(self) -> None:
        """Cancel every agent task and wait for each to log how its turn ended.

        Waits at most ``shutdown_deadline`` seconds: a task still running then
        (a tool that ignores cancellation) is abandoned and reported, so leaving
        the runtime always completes.
        """
        self.stopping = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._config.shutdown_deadline)
            for task in pending:
                self._host.abandon(task, f"agent task {task.get_name()}")
        self.tasks.clear()
        for agent in self._registry.held():  # a dormant agent has nobody waiting
            if agent.task is None and (agent.mailbox is not None or agent.postponed):
                # Posted after its task ended: one last task answers them, and ends.
                self.ensure_running(agent)
        while self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self._config.shutdown_deadline)
            for task in [t for t in self.tasks if not t.done()]:
                self._host.abandon(task, f"agent task {task.get_name()}")
                self.tasks.discard(task)


def _log(log: Any, level: str, message: str, **fields: Any) -> None:
    """Log, and never let logging fail the caller (a supervisor must not die of it)."""
    with contextlib.suppress(Exception):  # the one place a failure is dropped: logging
        getattr(log, level)(message, **fields)
