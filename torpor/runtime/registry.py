"""The registry of agents in memory, and the idle queues the lifecycle sweep walks.

Idle agents sit in two least-recently-used queues (with a working set, and
hibernated); busy agents sit in neither. Queues are ordered by last activity,
so a sweep pops from the front only what has been idle long enough and stops
at the first that has not: it costs O(agents it acts on), not O(agents).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from torpor.actors.agent import Agent

__all__ = ["Registry"]


class Registry:
    __slots__ = ("agents", "hibernated", "idle")

    def __init__(self) -> None:
        self.agents: dict[str, Agent] = {}
        self.idle: OrderedDict[str, Agent] = OrderedDict()  # awaiting input, working set held
        self.hibernated: OrderedDict[str, Agent] = OrderedDict()  # working set dropped

    def __len__(self) -> int:
        return len(self.agents)

    def __iter__(self) -> Iterator[Agent]:
        return iter(self.agents.values())

    def get(self, conversation_id: str) -> Agent | None:
        return self.agents.get(conversation_id)

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
        return next(iter(self.hibernated.values()), None)
