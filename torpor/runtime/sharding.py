"""What a clustered runtime adds: requests only for shards it serves, agents that move away.

:class:`ShardGate` is the runtime's :class:`~torpor.cluster.ShardHost`. It
refuses a request for a conversation whose shard this node does not serve
(:class:`~torpor.errors.NotOwner`, with the owner's address), and when a shard
leaves it takes that shard's agents out of the runtime: waiting requests and
turns fail with :class:`~torpor.errors.ShardMoved` (retry at the new owner),
followers are closed (they reconnect there), and agent tasks are cancelled and
awaited; a turn cut off this way tries to log its ``Aborted``, which the
database refuses once the new owner holds the lease (the new owner logs
``Aborted(interrupted)`` on revival instead).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from torpor.actors.state import AgentState
from torpor.cluster import NodeConfig, shard_of
from torpor.cluster.leases import Leases
from torpor.cluster.member import ClusterMember
from torpor.cluster.view import ClusterView
from torpor.errors import NotOwner, ShardMoved

if TYPE_CHECKING:
    from collections.abc import Callable

    from torpor.actors.agent import Agent
    from torpor.runtime.admission import Admission
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters, Watchers

__all__ = ["Recovering", "Redriving", "Retiring", "ShardGate"]


class Retiring(Protocol):
    """The supervisor as a moving shard sees it."""

    def retire(self, agent: Agent, error: BaseException) -> asyncio.Task[None] | None:
        """Stop the agent for good, failing what waits on it with ``error``; its task."""
        ...


class Recovering(Protocol):
    """The sub-agent links (``spawn.Branches``) as a gained shard sees them."""

    def recover(self, parents: Callable[[str], bool] | None) -> None: ...


class Redriving(Protocol):
    """The re-drive of owed work (``redrive.Redrive``) as a gained shard sees it."""

    def run(
        self,
        *,
        shards: frozenset[int] | None = None,
        shard_count: int | None = None,
        serves: Callable[[str], bool] | None = None,
    ) -> None: ...


class ShardGate:
    __slots__ = (
        "_admission", "_branches", "_config", "_counters", "_host", "_redrive", "_registry",
        "_supervisor", "_watchers", "member",
    )

    def __init__(
        self,
        dsn: str,
        node: NodeConfig,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        watchers: Watchers,
        host: AgentHost,
        admission: Admission,
        supervisor: Retiring,
        branches: Recovering,
        redrive: Redriving,
    ) -> None:
        self._config = config
        self._registry = registry
        self._counters = counters
        self._watchers = watchers
        self._host = host
        self._admission = admission
        self._supervisor = supervisor
        self._branches = branches
        self._redrive = redrive
        self.member = ClusterMember(dsn, node, self)

    @property
    def fence(self) -> Leases:
        return self.member.leases

    async def __aenter__(self) -> ShardGate:
        await self.member.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.member.leave()

    def check(self, conversation_id: str) -> None:
        leases = self.member.leases
        shard = shard_of(conversation_id, leases.shards)
        if not leases.serving(shard):
            raise NotOwner(conversation_id, shard, leases.owner_address(shard))

    def serves(self, conversation_id: str) -> bool:
        leases = self.member.leases
        return leases.serving(shard_of(conversation_id, leases.shards))

    def colocated(self, a: str, b: str) -> bool:
        shards = self.member.leases.shards
        return shard_of(a, shards) == shard_of(b, shards)

    async def view(self) -> ClusterView:
        """The shards, the members and the lease table, read from the database now."""
        return await self.member.view()

    # -- torpor.cluster.ShardHost ---------------------------------------------------------
    def shards_gained(self, shards: frozenset[int]) -> None:
        count = self.member.leases.shards
        # Sub-agent links the previous owner left open (it died or handed the shard off).
        self._branches.recover(lambda c: shard_of(c, count) in shards)
        # Turns it left open and postponed messages it acknowledged: run here, now.
        self._redrive.run(shards=shards, shard_count=count, serves=self.serves)

    async def shards_lost(self, shards: frozenset[int]) -> None:
        await self._evict(self._agents_of(shards), shards)

    async def shards_leaving(self, shards: frozenset[int], deadline: float) -> None:
        # Woken by every state change (the admin watchers' feed), until the shard's turns
        # have all ended or the deadline passed; then whatever still runs is cut off.
        until = time.monotonic() + deadline
        agents = self._agents_of(shards)
        with self._watchers.watch(1024) as changes:
            while any(_in_turn(a) for a in agents):
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                try:  # asyncio.timeout: a cancel is never lost (see cluster.member._manager)
                    async with asyncio.timeout(remaining):
                        await anext(changes)
                except (TimeoutError, StopAsyncIteration):
                    break
        await self._evict(self._agents_of(shards), shards)

    # -- taking agents out -------------------------------------------------------------------
    def _agents_of(self, shards: frozenset[int]) -> list[Agent]:
        registry = self._registry
        count = self.member.leases.shards
        registry.wake_where(lambda c: shard_of(c, count) in shards)  # held: retired below
        agents = [a for a in registry.held() if shard_of(a.id, count) in shards]
        agents += [a for a in self._admission.queue.values() if shard_of(a.id, count) in shards]
        return agents

    async def _evict(self, agents: list[Agent], shards: frozenset[int]) -> None:
        leases = self.member.leases
        tasks: list[asyncio.Task[None]] = []
        for agent in agents:
            task = self._retire(agent, self._moved(agent.id, shard_of(agent.id, leases.shards)))
            if task is not None:
                tasks.append(task)
        followers = self._host.followers_by_id
        for conversation_id, shard in [
            (c, s) for c in followers if (s := shard_of(c, leases.shards)) in shards
        ]:
            error = self._moved(conversation_id, shard)
            for follower in list(followers.get(conversation_id, ())):
                follower.close(error)  # it follows the conversation on its new owner
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._config.shutdown_deadline)
            for task in pending:
                self._host.abandon(task, f"agent task {task.get_name()} of a moved shard")

    def _moved(self, conversation_id: str, shard: int) -> ShardMoved:
        return ShardMoved(conversation_id, shard, self.member.leases.owner_address(shard))

    def _retire(self, agent: Agent, error: ShardMoved) -> asyncio.Task[None] | None:
        """Out of this runtime; its own task fails what waits on it with ``error``."""
        self._registry.remove(agent)
        self._admission.drop(agent.id)
        self._host.forget_bytes(agent)
        self._counters.evictions += 1
        return self._supervisor.retire(agent, error)  # its task reports it evicted


def _in_turn(agent: Agent) -> bool:
    return agent.turn_running or agent.state in (
        AgentState.STREAMING, AgentState.RUNNING_TOOLS, AgentState.REVIVING
    )

