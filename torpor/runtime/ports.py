"""What the runtime's parts need of one another, as narrow protocols.

The :class:`~torpor.runtime.host.Runtime` is a facade: its collaborators (the
agents' host, admission, lifecycle, supervisor, sub-agents, shards, admin,
task cards) never see it. Each receives the objects it works with (the
registry, the counters, the agents' host...) and, for what only the runtime
can answer, the protocols below, as :mod:`torpor.cluster.member` receives a
``ShardHost``. The runtime implements them in ``torpor.runtime.host`` (the one
module that knows its own attributes).

Nothing here imports from :mod:`torpor.runtime`: every module there may import
this one without making a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Profile
    from torpor.cluster.view import ClusterView, ShardRoute
    from torpor.store.protocol import EventStore

__all__ = ["Conversations", "Gate", "Queue", "Room", "Starter", "Stored"]


class Stored(Protocol):
    @property
    def store(self) -> EventStore:
        """The open event store (``RuntimeClosed`` outside ``async with``)."""
        ...


# The agents' host, the lifecycle and the admission queue each call the others (an agent
# idling makes room, a slot freed admits the queue's head, a newcomer sheds the least
# recently used): they reach one another through Room and Queue, which the runtime answers.


class Room(Protocol):
    """Room under the caps: the lifecycle sheds idle agents (``Lifecycle``)."""

    def shed_agents(self, *, keep: Agent | None, below: int | None = None) -> None:
        """Evict the least recently used idle agents while over ``max_live_agents``
        (or until fewer than ``below`` are live)."""
        ...

    def shed_memory(self, *, keep: Agent) -> None:
        """Hibernate the least recently used idle agents while over the memory cap."""
        ...


class Queue(Protocol):
    """Conversations waiting for a live slot (``Admission``)."""

    def queued(self) -> int:
        """Conversations waiting for a live slot."""
        ...

    def admit(self) -> None:
        """Give free slots to the conversations waiting for one."""
        ...


class Starter(Protocol):
    """The supervisor as a caller sees it: an agent with a request gets a task."""

    def ensure_running(self, agent: Agent, *, delay: float = 0.0) -> None: ...


class Conversations(Protocol):
    """The runtime's own answers about conversations (their agent, their profile)."""

    def check_open(self) -> None:
        """``RuntimeClosed`` unless the runtime is running."""
        ...

    def profile_for(self, conversation_id: str) -> Profile:
        """The conversation's AgentConfig, made ready to run (shared by its agents)."""
        ...

    def agent(self, conversation_id: str) -> Agent:
        """The conversation's agent, made (not revived) if it is not in memory."""
        ...

    async def known(self, conversation_id: str) -> Agent | None:
        """The agent if the conversation exists (in memory or in the log)."""
        ...


class Gate(Protocol):
    """A cluster node's view of its shards (``torpor.runtime.sharding.ShardGate``)."""

    def serves(self, conversation_id: str) -> bool: ...

    async def view(self) -> ClusterView: ...

    def route(self, conversation_id: str) -> ShardRoute: ...

    async def settled(self, conversation_id: str) -> ShardRoute: ...

    async def moved(self, conversation_id: str, owner: str) -> ShardRoute: ...

    def depart(self, deadline: float | None = None) -> None: ...
