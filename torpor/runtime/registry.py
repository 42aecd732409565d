"""The registry of agents in memory, and the idle queues the lifecycle sweep walks.

Idle agents sit in two least-recently-used queues (with a working set, and
hibernated); busy agents sit in neither. Queues are ordered by last activity,
so a sweep pops from the front only what has been idle long enough and stops
at the first that has not: it costs O(agents it acts on), not O(agents).

A hibernated agent that nothing else holds goes *dormant*: it leaves
``agents`` for a row of the :class:`~torpor.runtime.dormant.DormantTable`
(no Python object per agent, so a burst's heap can be given back; see that
module). :meth:`Registry.get` rebuilds it as an Agent, transparently, so
callers only ever see one Agent per conversation. That needs every holder to
say so: code that keeps an agent across an ``await`` and uses it afterwards
calls :meth:`Registry.hold` before and :meth:`Registry.release` after (or
``with registry.holding(agent):``), and a held agent never goes dormant, so
no caller is left with a stale copy. What an agent owns for itself (a task, a
mailbox with requests, a write lock, a working set: ``dormant.DROPPED``)
already keeps it an object. The count lives here, by id, only while nonzero:
an idle agent costs nothing for it. Dormant agents count in ``len()`` and are
hibernated and in the hibernated queue, as before.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torpor.actors.agent import Agent
from torpor.runtime.dormant import DormantTable, can_rest

__all__ = ["Registry"]


class Registry:
    __slots__ = ("_holders", "_resting", "agents", "dormant", "hibernated", "idle")

    def __init__(self) -> None:
        self.agents: dict[str, Agent] = {}  # held as objects (live, or hibernated and held)
        self.idle: OrderedDict[str, Agent] = OrderedDict()  # awaiting input, working set held
        self.hibernated: OrderedDict[str, Agent] = OrderedDict()  # working set dropped
        self.dormant = DormantTable()  # hibernated, as rows: after the queue above
        self._resting: list[str] | None = None  # ids to try making dormant, soon
        self._holders: dict[str, int] = {}  # holders outside the registry, by id: never 0

    def __len__(self) -> int:
        return len(self.agents) + len(self.dormant)

    def __contains__(self, conversation_id: str) -> bool:
        return conversation_id in self.agents or conversation_id in self.dormant

    def __iter__(self) -> Iterator[Agent]:
        """Every agent: the held ones, then a read-only copy of each dormant one."""
        yield from self.agents.values()
        yield from self.dormant.peek()

    def held(self) -> Iterator[Agent]:
        """The agents held as objects (a dormant one has nothing to stop or answer)."""
        return iter(list(self.agents.values()))

    def states(self) -> dict[str, int]:
        """Agents by state, dormant ones included, without rebuilding them."""
        counts = self.dormant.states()
        for agent in self.agents.values():
            key = str(agent.state)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def get(self, conversation_id: str) -> Agent | None:
        agent = self.agents.get(conversation_id)
        if agent is None and self.dormant:
            agent = self.dormant.take(conversation_id)
            if agent is not None:
                self._hold(agent)
        return agent

    def wake_where(self, wanted: Callable[[str], bool]) -> None:
        """Hold every dormant agent whose id is ``wanted`` as an object again."""
        for conversation_id in [c for c in self.dormant.ids() if wanted(c)]:
            self.get(conversation_id)

    def _hold(self, agent: Agent) -> None:
        """A dormant agent rebuilt: held again, at the front of the hibernated queue
        when it is older than everything there (it usually is: it was dormant)."""
        self.agents[agent.id] = agent
        queue = self.hibernated
        oldest = next(iter(queue.values()), None)
        queue[agent.id] = agent
        if oldest is None or oldest.last_active >= agent.last_active:
            queue.move_to_end(agent.id, last=False)

    def add(self, agent: Agent) -> None:
        self.agents[agent.id] = agent

    def remove(self, agent: Agent) -> None:
        if self.agents.get(agent.id) is agent:
            del self.agents[agent.id]
        self.unqueue(agent)

    def unqueue(self, agent: Agent) -> None:
        """Busy: in neither idle queue."""
        self.idle.pop(agent.id, None)
        self.hibernated.pop(agent.id, None)

    def queue_idle(self, agent: Agent) -> None:
        self.hibernated.pop(agent.id, None)
        self.idle[agent.id] = agent
        self.idle.move_to_end(agent.id)

    def queue_hibernated(self, agent: Agent) -> None:
        self.idle.pop(agent.id, None)
        self.hibernated[agent.id] = agent
        self.hibernated.move_to_end(agent.id)

    def oldest_idle(self) -> Agent | None:
        return next(iter(self.idle.values()), None)

    def oldest_hibernated(self) -> Agent | None:
        """The least recently active hibernated agent, held (rebuilt if it was dormant)."""
        held = next(iter(self.hibernated.values()), None)
        since = self.dormant.oldest_last_active()
        if since is None or (held is not None and held.last_active <= since):
            return held
        agent = self.dormant.take_oldest()
        assert agent is not None
        self._hold(agent)
        return agent

    def oldest_hibernated_since(self) -> float | None:
        """When the least recently active hibernated agent was last active (no rebuild)."""
        held = next(iter(self.hibernated.values()), None)
        since = self.dormant.oldest_last_active()
        if held is None:
            return since
        return held.last_active if since is None else min(since, held.last_active)

    # -- holders ------------------------------------------------------------------------
    def hold(self, agent: Agent) -> None:
        """Someone keeps ``agent`` across an await: it stays an object until released."""
        holders = self._holders
        holders[agent.id] = holders.get(agent.id, 0) + 1

    def release(self, agent: Agent) -> None:
        """The holder let go; the last one lets a hibernated agent go dormant (soon)."""
        holders = self._holders
        left = holders[agent.id] - 1
        if left:
            holders[agent.id] = left
            return
        del holders[agent.id]
        if agent.id in self.hibernated and self.agents.get(agent.id) is agent:
            self.rest(agent.id)

    @contextmanager
    def holding(self, agent: Agent) -> Iterator[Agent]:
        self.hold(agent)
        try:
            yield agent
        finally:
            self.release(agent)

    # -- going dormant -------------------------------------------------------------------
    def rest(self, conversation_id: str) -> None:
        """Try to make the agent dormant soon: after the task or call that hibernated it
        (still running now) has finished with it."""
        resting = self._resting
        if resting is None:
            self._resting = resting = []
            asyncio.get_running_loop().call_soon(self._rest_all)
        resting.append(conversation_id)

    def rest_hibernated(self) -> int:
        """Make every hibernated agent nobody holds dormant (the sweep's retry for those
        that still owned something when they hibernated)."""
        return sum(self._rest(c) for c in list(self.hibernated))

    def _rest_all(self) -> None:
        resting, self._resting = self._resting or [], None
        for conversation_id in resting:
            self._rest(conversation_id)
        if not self.agents:  # a dict never shrinks: after a burst its table would stay
            self.agents = {}
            self.hibernated = OrderedDict()
            self.idle = OrderedDict()

    def _rest(self, conversation_id: str) -> bool:
        agent = self.agents.get(conversation_id)
        if agent is None or conversation_id not in self.hibernated or not can_rest(agent):
            return False
        if conversation_id in self._holders:
            return False  # a caller keeps it across an await: it stays an object
        del self.agents[conversation_id]
        del self.hibernated[conversation_id]
        self.dormant.put(agent)
        return True
