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

import anyio

from torpor.actors.actor import fail, run_agent
from torpor.actors.state import AgentState
from torpor.errors import (
    AgentParked,
    CorruptEvent,
    FencedError,
    RuntimeClosed,
    StoreUnavailable,
    TurnAborted,
)
from torpor.events import Parked

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.host import Runtime

__all__ = ["Supervisor"]


class Supervisor:
    __slots__ = ("_rt", "retired", "stopping", "tasks")

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self.tasks: set[asyncio.Task[Any]] = set()
        self.retired: set[Agent] = set()  # taken out of the runtime (its shard moved)
        self.stopping = False

    def retire(self, agent: Agent) -> None:
        """Stop the agent's task for good: however it ends, it is not restarted."""
        if agent.task is not None:
            self.retired.add(agent)
            agent.task.cancel()

    def ensure_running(self, agent: Agent, *, delay: float = 0.0) -> None:
        """Give the agent a task if it has none (a hibernated or new agent has none)."""
        if agent.task is not None:
            return
        if self.stopping:
            _fail_waiting(agent, RuntimeClosed("the runtime is stopping"))
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
            await run_agent(agent, self._rt._host, delay=delay)
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
            if self.stopping:
                _fail_waiting(agent, RuntimeClosed("the runtime stopped"))
        if retired:  # its shard moved to another node, which serves it from the log
            return
        try:
            if isinstance(crash, FencedError):
                self._fenced(agent, crash)  # before StoreUnavailable: retrying cannot help
            elif isinstance(crash, StoreUnavailable):
                self._store_down(agent, crash)
            elif isinstance(crash, CorruptEvent) and agent.ws is None:
                self._unreadable(agent, crash)  # its revival could not read the log back
            elif crash is not None:
                self._crashed(agent, crash)
            elif (
                (agent.mailbox_depth() or agent.runnable_postponed())
                and not self.stopping
                and agent.state is not AgentState.PARKED
            ):
                self.ensure_running(agent)  # a message arrived as it hibernated
            elif agent.task is None and agent.ws is None and not self.stopping:
                self._rt._registry.rest(agent.id)  # hibernated: dormant once this task ends
        except Exception as exc:  # handling a failure failed: keep every promise anyway
            _fail_waiting(agent, TurnAborted("crashed", "", f"{type(exc).__name__}: {exc}"))
            agent.ws = None
            agent.state = AgentState.REVIVING
            if not self.stopping:
                self.ensure_running(agent, delay=self._rt.config.backoff_max)

    def _drop_turn(self, agent: Agent, error: BaseException) -> None:
        """Fail the open turn's waiters and drop the caches: the restart reads the log."""
        rt = self._rt
        if agent.current is not None:
            agent.current._fail(error)
            agent.current = None
        if agent.hub is not None:
            agent.unlogged = "".join(agent.hub.parts)  # streamed, not logged: still owed
            agent.hub.close(error)
            agent.hub = None
        cancels, agent.cancels = agent.cancels, None
        for future in cancels or ():
            if not future.done():
                future.set_result(False)  # the turn was not cancelled: it broke
        agent.scope = None
        agent.cancellable = False
        agent.ws = None  # the log is the memory: the restart reads it back
        agent.lock = None
        rt._host.forget_bytes(agent)

    def _store_refused(self, agent: Agent, exc: StoreUnavailable, what: str) -> None:
        """Counted as the store's failure, never as the agent's crash."""
        self._rt._counters.store_failures += 1
        agent.last_error = f"{type(exc).__name__}: {exc}"
        _log(self._rt, "warning", what, conversation_id=agent.id, error=str(exc))

    def _store_down(self, agent: Agent, exc: StoreUnavailable) -> None:
        rt = self._rt
        self._store_refused(agent, exc, "store unavailable; retrying")
        self._drop_turn(agent, exc)
        # Requests not yet taken could only fail the same way now: tell their callers.
        mailbox = agent.mailbox
        agent.mailbox = None
        for message in mailbox.drain() if mailbox is not None else ():
            fail(message, exc)
        if self.stopping:
            return
        agent.store_failures += 1
        delay = min(
            self._rt.config.backoff_max,
            self._rt.config.backoff_initial * 2 ** (agent.store_failures - 1),
        )
        if agent.state is not AgentState.REVIVING:
            rt._host.transition(agent, agent.state, AgentState.REVIVING)
            agent.state = AgentState.REVIVING
        # Retry until the store writes again: the log may owe an Aborted for the turn
        # and postponed turns wait to run.
        self.ensure_running(agent, delay=delay)

    def _fenced(self, agent: Agent, exc: FencedError) -> None:
        """This node may no longer write the conversation (another node holds its shard,
        or the store belongs to a cluster and this runtime is no node of it).

        Retrying would be refused the same way forever: every waiting caller gets the
        error and the agent is forgotten, not restarted. The shard's owner serves it
        from the log (postponed turns included); a request here meets NotOwner.
        """
        self._store_refused(agent, exc, "conversation fenced; dropped")
        self._forget(agent, exc)

    def _unreadable(self, agent: Agent, exc: CorruptEvent) -> None:
        """The log does not read back (a hole, a row that does not decode).

        No restart can change that, and it is not the conversation's model or
        tools failing: no crash loop and no parking. Every waiting caller gets
        the CorruptEvent (naming the position) and the agent is forgotten, so
        the next request reads the log again, and fails the same way until the
        log is repaired.
        """
        rt = self._rt
        agent.last_error = f"CorruptEvent: {exc}"
        _log(rt, "error", "conversation log unreadable", conversation_id=agent.id,
             error=str(exc))
        self._forget(agent, exc)

    def _forget(self, agent: Agent, exc: Exception) -> None:
        """Fail everything waiting on the agent with ``exc`` and drop it from the runtime."""
        rt = self._rt
        self._drop_turn(agent, exc)
        _fail_waiting(agent, exc)
        postponed, agent.postponed = agent.postponed, None
        for waiting in postponed or ():
            waiting.turn._fail(exc)
        if rt._registry.get(agent.id) is agent:
            rt._registry.remove(agent)
            rt._host.transition(agent, agent.state, AgentState.EVICTED)

    def _crashed(self, agent: Agent, exc: BaseException) -> None:
        rt = self._rt
        rt._counters.crashes += 1
        cause = f"{type(exc).__name__}: {exc}"
        agent.last_error = cause
        _log(rt, "warning", "agent crashed", conversation_id=agent.id, error=cause, exc_info=exc)
        self._drop_turn(agent, TurnAborted("crashed", "", cause))
        if self.stopping:
            return
        now = time.monotonic()
        window = rt.config.restart_window
        agent.crash_times = (*(t for t in agent.crash_times if now - t < window), now)
        if len(agent.crash_times) > rt.config.max_restarts:
            self.spawn(self._park(agent, cause))
            return
        agent.restarts += 1
        rt._counters.restarts += 1
        n = len(agent.crash_times)
        delay = min(rt.config.backoff_max, rt.config.backoff_initial * 2 ** (n - 1))
        rt._host.transition(agent, agent.state, AgentState.REVIVING)
        agent.state = AgentState.REVIVING
        self.ensure_running(agent, delay=delay)

    async def _park(self, agent: Agent, cause: str) -> None:
        rt = self._rt
        rt._counters.parks += 1
        old = agent.state
        agent.state = AgentState.PARKED  # refuse input from now on
        agent.parked_cause = cause
        rt._registry.unqueue(agent)
        error = AgentParked(agent.id, cause)
        _fail_waiting(agent, error)
        try:
            with anyio.CancelScope(shield=True):
                events = await rt.store.append_events(
                    agent.id, [Parked(cause, restarts=agent.restarts)], turn=agent.turn
                )
            agent.head = max(agent.head, events[-1].position)
            rt._host.publish(agent.id, events)
        except Exception as exc:  # the store may be what keeps failing: stay parked in memory
            _log(rt, "error", "could not log parking", conversation_id=agent.id,
                 error=repr(exc))
        _log(rt, "error", "agent parked", conversation_id=agent.id, cause=cause,
             restarts=agent.restarts)
        rt._host.transition(agent, old, AgentState.PARKED)  # announced once it is in the log

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
            _, pending = await asyncio.wait(tasks, timeout=self._rt.config.shutdown_deadline)
            for task in pending:
                self._rt._host.abandon(task, f"agent task {task.get_name()}")
        self.tasks.clear()
        for agent in self._rt._registry.held():  # a dormant agent has nobody waiting
            _fail_waiting(agent, RuntimeClosed("the runtime stopped"))


def _fail_waiting(agent: Agent, error: BaseException) -> None:
    """Complete every request and postponed turn waiting on this agent with ``error``."""
    taken, agent.taken = agent.taken, None
    if taken is not None:
        fail(taken, error)  # no-op if it was answered
    mailbox = agent.mailbox
    agent.mailbox = None
    for message in mailbox.drain() if mailbox is not None else ():
        fail(message, error)
    if isinstance(error, AgentParked | RuntimeClosed):
        postponed, agent.postponed = agent.postponed, None
        reason = "shutdown" if isinstance(error, RuntimeClosed) else "crashed"
        for waiting in postponed or ():  # in the log: it runs when the agent next runs
            waiting.turn._fail(TurnAborted(reason, "", str(error)))


def _log(rt: Runtime, level: str, message: str, **fields: Any) -> None:
    """Log, and never let logging fail the caller (a supervisor must not die of it)."""
    with contextlib.suppress(Exception):  # the one place a failure is dropped: logging
        getattr(rt._log, level)(message, **fields)
