"""What the runtime gives its agents: the actors' ``Host``, kept off the Runtime's public face.

Agents call back into the runtime as their state changes (to be queued for
hibernation, counted, announced to watchers), as they log events (for the
conversation's followers) and when a tool ignores cancellation past its
deadline (the runtime takes the task over). Those hooks live here, so that
``dir(runtime)`` is the public API and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from torpor.actors.observe import Observers
from torpor.actors.state import AgentState, transition
from torpor.actors.stream import Follower
from torpor.actors.watchdog import ModelWatchdog
from torpor.events import Event
from torpor.runtime.ports import Queue, Room, Stored

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractAsyncContextManager

    from torpor.actors.agent import Agent
    from torpor.compaction.fusion import HybridRecall
    from torpor.llm.protocol import Model
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters, Watchers
    from torpor.store.protocol import EventStore

__all__ = ["AgentHost", "Hosting"]

_BUSY_STATES = (AgentState.STREAMING, AgentState.RUNNING_TOOLS, AgentState.REVIVING)


class Hosting(Stored, Room, Queue, Protocol):
    """What the host needs of the runtime: its store, room once an agent idles, and
    whether it is stopping (its agents then end their postponed turns in the log)."""

    @property
    def stopping(self) -> bool: ...


class AgentHost:
    """The runtime as its agents see it (implements ``torpor.actors.agent.Host``)."""

    __slots__ = (
        "_config", "_counters", "_registry", "_runtime", "_watchers", "abandoned",
        "followers_by_id", "hybrid", "log", "model", "observers", "poke_embedding",
        "poke_schedules", "revivals", "schedule_now", "watchdog", "ws_total",
    )

    def __init__(
        self,
        model: Model,
        log: Any,
        *,
        config: RuntimeConfig,
        registry: Registry,
        watchers: Watchers,
        counters: Counters,
        runtime: Hosting,
    ) -> None:
        self._config = config
        self._registry = registry
        self._watchers = watchers
        self._counters = counters
        self._runtime = runtime
        self.model = model
        self.log = log
        self.revivals: asyncio.Semaphore | None = None
        self.followers_by_id: dict[str, list[Follower]] = {}
        self.abandoned: set[asyncio.Task[Any]] = set()
        self.ws_total = 0  # estimated bytes of every working set held
        self.hybrid: HybridRecall | None = None  # recall fused with vectors (an embedder is set)
        self.poke_embedding: Callable[[], None] | None = None  # new events to embed
        # The schedules' clock (epoch ms) and timer (a new schedule due then), for the
        # model's schedule tool (torpor.actors.schedule_tool).
        self.schedule_now: Callable[[], int] = lambda: time.time_ns() // 1_000_000
        self.poke_schedules: Callable[[int], None] | None = None
        self.watchdog = ModelWatchdog()  # its task: Runtime.__aenter__
        self.observers = Observers()  # Runtime.observe adds to it

    @property
    def store(self) -> EventStore:
        return self._runtime.store

    def revival_slot(self) -> AbstractAsyncContextManager[None]:
        assert self.revivals is not None
        return self.revivals

    # -- state ---------------------------------------------------------------------
    def on_state(self, agent: Agent, old: AgentState, new: AgentState) -> None:
        if new in _BUSY_STATES:
            self._registry.unqueue(agent)
        self.transition(agent, old, new)

    def transition(self, agent: Agent, old: AgentState, new: AgentState) -> None:
        """Report a transition to the watchers: one the table declares, or InvalidTransition."""
        transition(agent.id, old, new)
        watchers = self._watchers
        if watchers:
            watchers.publish(agent.id, str(old), str(new))

    def on_hibernated(self, agent: Agent) -> None:
        self.forget_bytes(agent)
        forget = getattr(self._runtime.store, "_forget_head", None)
        if forget is not None:  # the store's cached head of the conversation: not kept
            forget(agent.id)
        if self._registry.agents.get(agent.id) is not agent:
            return  # evicted: already reported, and no longer queued anywhere
        agent.report(self, AgentState.HIBERNATED)
        self._registry.queue_hibernated(agent)

    def on_dropped(self, agent: Agent) -> None:
        self.forget_bytes(agent)

    @property
    def draining(self) -> bool:
        return self._runtime.stopping

    @property
    def restart_window(self) -> float:
        return self._config.restart_window

    def on_revived(self, agent: Agent, seconds: float) -> None:
        counters = self._counters
        counters.revivals += 1
        counters.revival_seconds.append(seconds)
        self.account(agent)

    def on_idle(self, agent: Agent) -> None:
        registry, config, room = self._registry, self._config, self._runtime
        self.account(agent)
        if registry.get(agent.id) is not agent or agent.busy:
            return
        if agent.state in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED):
            if agent.ws is not None:
                registry.queue_idle(agent)
            else:
                registry.queue_hibernated(agent)
        if self.ws_total > config.max_working_set_bytes:
            room.shed_memory(keep=agent)
        if room.queued():
            room.admit()  # conversations wait for a slot: idle ones make room
        elif len(registry) > config.max_live_agents:
            # Over the cap (a resolve let a queued conversation in): shed as agents idle.
            room.shed_agents(keep=agent)

    # -- memory accounting -----------------------------------------------------------
    def account(self, agent: Agent) -> None:
        """Fold the agent's measured working-set size into the runtime's total."""
        self.ws_total += agent.ws_bytes - agent.accounted
        agent.accounted = agent.ws_bytes

    def forget_bytes(self, agent: Agent) -> None:
        self.ws_total -= agent.accounted
        agent.accounted = 0

    # -- followers ---------------------------------------------------------------------
    def followers(self, conversation_id: str) -> list[Follower] | None:
        return self.followers_by_id.get(conversation_id)

    def publish(self, agent: Agent, events: list[Event]) -> None:
        if self.poke_embedding is not None:
            self.poke_embedding()
        if agent.ws is not None:  # live: a follower starting near the head reads them here
            agent.remember(events)
        followers = self.followers_by_id.get(agent.id)
        if followers:
            for follower in list(followers):
                for event in events:
                    follower.push(event)

    async def replay(self, conversation_id: str, position: int) -> list[Event]:
        """A follower's replay: what the log holds at or after ``position``."""
        return await self._runtime.store.read_since(conversation_id, position)

    def release(self, follower: Follower, conversation_id: str) -> None:
        followers = self.followers_by_id.get(conversation_id)
        if followers is None:
            return
        try:
            followers.remove(follower)
        except ValueError:
            return
        if not followers:
            del self.followers_by_id[conversation_id]

    def close_followers(self) -> None:
        for followers in list(self.followers_by_id.values()):
            for follower in list(followers):
                follower.close()
        self.followers_by_id.clear()

    # -- tasks that would not stop -------------------------------------------------------
    def abandon(self, task: asyncio.Task[Any], what: str) -> None:
        """Own a task that ignored cancellation past its deadline, and report it."""
        self._counters.abandoned += 1
        self.abandoned.add(task)
        self.log.error("task_abandoned", task=what)

        def finished(done: asyncio.Task[Any]) -> None:
            self.abandoned.discard(done)
            if not done.cancelled():
                done.exception()  # retrieved: it was reported when abandoned

        task.add_done_callback(finished)
