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
import contextlib
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from torpor.actors.state import AgentState
from torpor.cluster import NodeConfig, shard_of
from torpor.cluster.leases import Leases
from torpor.cluster.member import ClusterMember
from torpor.cluster.view import ClusterView, ShardRoute
from torpor.errors import NotOwner, ShardMoved
from torpor.store.postgres.errors import DRIVER_ERRORS, store_error

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
            raise NotOwner(conversation_id, shard, leases.owner_address(shard),
                           moving=leases.moving(shard))

    def serves(self, conversation_id: str) -> bool:
        leases = self.member.leases
        return leases.serving(shard_of(conversation_id, leases.shards))

    def _holds(self, conversation_id: str) -> bool:
        leases = self.member.leases
        shard = shard_of(conversation_id, leases.shards)
        return shard in leases.held and shard not in leases.leaving

    def colocated(self, a: str, b: str) -> bool:
        shards = self.member.leases.shards
        return shard_of(a, shards) == shard_of(b, shards)

    async def hand_off_all(self) -> None:
        """Leave's first half, while the runtime still answers (see ClusterMember)."""
        await self.member.hand_off_all()

    def depart(self, deadline: float | None = None) -> None:
        """Begin the graceful leave now (the runtime's exit completes it)."""
        self.member.depart(deadline)

    async def view(self) -> ClusterView:
        """The shards, the members and the lease table, read from the database now
        (``StoreUnavailable`` while it cannot answer)."""
        try:
            return await self.member.view()
        except DRIVER_ERRORS as exc:
            raise store_error(exc, "cannot read the lease table") from exc

    # -- routing by the lease cache (the HTTP layer's) -------------------------------------
    @property
    def handoff_wait(self) -> float:
        """How long a shard in hand-off takes to land: the holder lets go within the
        hand-off deadline (its lease expires within the TTL if it died; a deadline far
        past the TTL is not waited out), the new owner acquires it at its next refresh,
        and this node's cache learns it at its next."""
        node = self.member.config
        return min(node.handoff_deadline, node.lease_ttl + 2.0) + 2 * node.refresh_every

    def route(self, conversation_id: str) -> ShardRoute:
        leases = self.member.leases
        shard = shard_of(conversation_id, leases.shards)
        serving = leases.serving(shard)
        return ShardRoute(
            node_id=self.member.config.node_id, shard=shard, serving=serving,
            moving=not serving and leases.moving(shard),
            owner=None if serving else leases.owner_address(shard),
        )

    async def settled(self, conversation_id: str) -> ShardRoute:
        """The route once the shard is no longer in hand-off through this node, or as it
        stands after :attr:`handoff_wait` seconds."""
        return await self._until(conversation_id, lambda r: not r.moving, self.handoff_wait)

    async def moved(self, conversation_id: str, owner: str) -> ShardRoute:
        """The route once ``owner`` stopped renewing (no live node has its address) and
        the cache no longer sends the conversation there (served here, in hand-off to
        here, or held by another node). A live owner handing the shard off is not waited
        past: it answers (421, naming the new owner). A cache that already disagreed with
        ``owner`` (stale, while ``owner`` came from the table) must change first. No
        bound: the caller cancels it when it stops caring."""
        leases = self.member.leases
        than = self.route(conversation_id)

        def gone(route: ShardRoute) -> bool:
            return (route != than and (route.serving or route.moving or route.owner != owner)
                    and owner not in leases.live.values())

        return await self._until(conversation_id, gone, None)

    async def _until(
        self, conversation_id: str, done: Callable[[ShardRoute], bool], within: float | None
    ) -> ShardRoute:
        leases = self.member.leases
        poll = self.member.config.refresh_every  # a change missed is seen at the next look
        route = self.route(conversation_id)
        until = None if within is None else time.monotonic() + within
        while not done(route):
            wait = poll if until is None else min(poll, until - time.monotonic())
            if wait <= 0:
                break
            # asyncio.timeout, not wait_for: a cancel is never lost (cluster.member._manager)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await leases.next_change()
            route = self.route(conversation_id)
        return route

    # -- torpor.cluster.ShardHost ---------------------------------------------------------
    def shards_gained(self, shards: frozenset[int]) -> None:
        count = self.member.leases.shards
        # Sub-agent links the previous owner left open (it died or handed the shard off).
        self._branches.recover(lambda c: shard_of(c, count) in shards)
        # Turns it left open and postponed messages it acknowledged: run here, now.
        # Held, not necessarily serving yet: a node that acquires while its own renewal is
        # late still owes these (its fence stops any write if it lost them meanwhile).
        self._redrive.run(shards=shards, shard_count=count, serves=self._holds)

    async def shards_lost(self, shards: frozenset[int]) -> None:
        await self._evict(self._agents_of(shards), shards)

    async def shards_leaving(
        self, shards: frozenset[int], deadline: float
    ) -> AsyncIterator[frozenset[int]]:
        # A shard goes as soon as its own turns have ended, so the newcomer gets the idle
        # ones at once. Woken by every state change (the admin watchers' feed); at the
        # deadline whatever still runs is cut off. New requests for these shards are
        # refused already, so only agents in a turn now can hold a shard back.
        count = self.member.leases.shards
        until = time.monotonic() + deadline
        left = set(shards)
        # New requests for these shards are refused from now on, but one admitted just before
        # may still be on its way into a mailbox or the log: its agent counts as busy too.
        busy = [a for a in self._registry.held() if shard_of(a.id, count) in left]
        with self._watchers.watch(1024) as changes:
            while left:
                busy = [a for a in busy if _busy(a)]
                held_back = {shard_of(a.id, count) for a in busy}
                ready = frozenset(
                    left if time.monotonic() >= until else left - held_back
                )
                if ready:
                    await self._evict(self._agents_of(ready), ready)
                    left -= ready
                    yield ready
                    continue
                try:  # asyncio.timeout: a cancel is never lost (see cluster.member._manager)
                    async with asyncio.timeout(until - time.monotonic()):
                        await anext(changes)
                except TimeoutError:
                    pass
                except StopAsyncIteration:
                    until = 0.0  # no more news: cut off what is left

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
        leases = self.member.leases
        return ShardMoved(conversation_id, shard, leases.owner_address(shard),
                          moving=leases.moving(shard))

    def _retire(self, agent: Agent, error: ShardMoved) -> asyncio.Task[None] | None:
        """Out of this runtime; its own task fails what waits on it with ``error``."""
        self._registry.remove(agent)
        self._admission.drop(agent.id)
        self._host.forget_bytes(agent)
        self._counters.evictions += 1
        return self._supervisor.retire(agent, error)  # its task reports it evicted


def _busy(agent: Agent) -> bool:
    """In a turn, or about to start one: mail waiting, a message being logged, or turns
    postponed behind the one that runs (acknowledged, so they finish where their callers
    wait; no new ones come in while the shard leaves)."""
    return agent.turn_running or agent.state in (
        AgentState.STREAMING, AgentState.RUNNING_TOOLS, AgentState.REVIVING
    ) or agent.has_work() or agent.taken is not None or agent.runnable_postponed()

