"""Lifecycle policy: hibernate idle agents, evict long-idle ones, shed load over the caps.

No timer per agent: one sweep every ``sweep_every`` seconds walks the idle
queues from their oldest end and stops at the first agent that has not been
idle long enough, so each sweep costs O(agents it acts on).

Hibernating or evicting an agent also drops the store's cached head of its
conversation (the SQLite writer's head cache): an entry written during a burst
would pin the heap around it, and the next append after revival reads the head
again anyway. A hibernated agent whose task has ended goes dormant (see
:mod:`torpor.runtime.registry`); the sweep retries those that were still
referred to when they hibernated.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import anyio

from torpor.actors.mailbox import HIBERNATE, HibernateRequest
from torpor.actors.state import AgentState

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.ports import Queue
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters

__all__ = ["Lifecycle"]


class Lifecycle:
    __slots__ = ("_config", "_counters", "_host", "_queue", "_registry")

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        host: AgentHost,
        queue: Queue,
    ) -> None:
        self._config = config
        self._registry = registry
        self._counters = counters
        self._host = host
        self._queue = queue  # the admission queue, which sheds through this: late-bound

    async def run(self) -> None:
        every = self._config.sweep_every
        while True:
            await anyio.sleep(every)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> tuple[int, int]:
        """Hibernate and evict what has idled long enough; returns (hibernated, evicted)."""
        registry = self._registry
        hibernate_before = now - self._config.hibernate_after
        evict_before = now - self._config.evict_after
        hibernated = evicted = 0
        while (agent := registry.oldest_idle()) is not None:
            if agent.last_active > hibernate_before:
                break
            if self.hibernate(agent):
                hibernated += 1
            elif agent.id in registry.idle:
                registry.unqueue(agent)  # busy: it queues itself again once idle
        while (since := registry.oldest_hibernated_since()) is not None:
            if since > evict_before:
                break
            agent = registry.oldest_hibernated()  # rebuilt if it was dormant
            if agent is not None and self.evict(agent):
                evicted += 1
        registry.rest_hibernated()
        if self._queue.queued():
            self._queue.admit()
        return hibernated, evicted

    def hibernate(self, agent: Agent, done: asyncio.Future[bool] | None = None) -> bool:
        """Ask an idle agent to drop its working set and task (it keeps its ids and
        positions). True when asked: the agent does it, and reports ``hibernated``, once
        it takes the request (``done``: True then, False when it was no longer idle)."""
        if agent.busy or agent.state not in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED):
            return False
        if agent.ws is None or agent.task is None:  # nothing held: already hibernated
            self._registry.queue_hibernated(agent)
            return False
        self._registry.unqueue(agent)  # out of the idle queue until it reports back
        agent.post(HIBERNATE if done is None else HibernateRequest(done))
        self._counters.hibernations += 1  # asked of an idle agent: it does so when it reads it
        return True

    def evict(self, agent: Agent) -> bool:
        """Forget the agent entirely (the log keeps everything). Never mid-turn."""
        if not agent.evictable or agent.state not in (
            AgentState.AWAITING_INPUT, AgentState.SUSPENDED, AgentState.PARKED
        ):
            self._registry.unqueue(agent)
            return False
        self._registry.remove(agent)
        if agent.task is not None:
            agent.post(HIBERNATE)  # its task ends; nothing else writes it any more
        self._host.forget_bytes(agent)
        self._forget_head(agent)
        self._counters.evictions += 1
        agent.report(self._host, AgentState.EVICTED)
        return True

    def _forget_head(self, agent: Agent) -> None:
        """Drop the store's cached head of the conversation, if it caches heads."""
        forget = getattr(self._host.store, "_forget_head", None)
        if forget is not None:
            forget(agent.id)

    def shed_agents(self, *, keep: Agent | None, below: int | None = None) -> None:
        """Evict the least recently used idle agents while the registry is over the cap
        (or, with ``below``, until it holds fewer than ``below``: room for a newcomer)."""
        registry = self._registry
        limit = self._config.max_live_agents if below is None else below - 1
        while len(registry) > limit:
            victim = registry.oldest_hibernated() or registry.oldest_idle()
            if victim is None or victim is keep:
                return
            if not self.evict(victim):
                registry.unqueue(victim)

    def shed_memory(self, *, keep: Agent) -> None:
        """Over ``max_working_set_bytes``: hibernate the least recently used idle agents."""
        while self._host.ws_total > self._config.max_working_set_bytes:
            victim = self._registry.oldest_idle()
            if victim is None or victim is keep:
                return
            if not self.hibernate(victim) and victim.id in self._registry.idle:
                self._registry.unqueue(victim)
