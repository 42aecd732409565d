"""The admin surface: what every agent is doing, without waking the ones that sleep.

Nothing here revives an evicted agent: questions about one are answered from
the store.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from torpor.actors.mailbox import UnparkRequest
from torpor.actors.revive import restore
from torpor.actors.state import AgentState
from torpor.cluster.view import ClusterView, ShardRoute
from torpor.compaction.audit import rebuild_rendered, redacted_since
from torpor.compaction.recipe import Rendered, decode_recipe
from torpor.errors import CorruptEvent, InvalidInput, UnknownConversation
from torpor.events import Parked, Unparked, presented
from torpor.runtime.ports import Stored
from torpor.runtime.spawn import branch_tree
from torpor.runtime.stats import Watcher, percentile
from torpor.store.protocol import ModelCall
from torpor.store.schedules import SchedulePage
from torpor.text import check_id

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Collection

    from torpor.actors.agent import Agent, Profile
    from torpor.runtime.admission import Admission
    from torpor.runtime.embedding import EmbeddingStats, EmbeddingWorker
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.memory_api import MemoryView
    from torpor.runtime.ports import Gate
    from torpor.runtime.registry import Registry
    from torpor.runtime.spawn import Branch
    from torpor.runtime.stats import Counters, Watchers
    from torpor.store.protocol import PendingApproval

__all__ = ["Admin", "Administered", "AgentInfo", "Caretaker", "RenderedCall", "RuntimeStats"]


class AgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    conversation_id: str
    state: str
    hibernated: bool
    live: bool  # in memory (hibernated included)
    idle_seconds: float | None
    mailbox_depth: int  # requests not yet taken by the agent
    restarts: int
    working_set_tokens: int
    working_set_bytes: int
    head: int | None = None
    checkpoint_position: int | None = None
    tail_length: int | None = None
    turn: int | None = None
    pending_calls: tuple[str, ...] = ()
    last_error: str | None = None
    parked_cause: str | None = None
    postponed: int = 0  # user messages logged behind the open turn, waiting to run


class RuntimeStats(msgspec.Struct, frozen=True, kw_only=True):
    states: dict[str, int]
    live: int
    hibernated: int
    with_working_set: int
    tasks: int
    working_set_bytes: int
    activations: int
    revivals: int
    hibernations: int
    evictions: int
    crashes: int
    restarts: int
    parks: int
    store_failures: int  # turns or revivals stopped by StoreUnavailable (not crashes)
    queued: int  # conversations waiting for a live slot (max_live_agents), in no state
    queue_wait_p50_ms: float | None
    queue_wait_p99_ms: float | None
    abandoned: int  # tasks that ignored cancellation past their deadline
    revival_p50_ms: float | None
    revival_p99_ms: float | None
    consolidation_failures: int = 0  # idle-sweep consolidations that failed or timed out
    retention_deletions: int = 0  # conversations deleted by the retention sweep


class RenderedCall(msgspec.Struct, frozen=True):
    """A model call's context rebuilt from the log and its recipe; ``matches``: same hash.

    ``redacted``: positions the call's context drew on that were redacted since
    (``Runtime.redact``): the rebuild shows them as "[redacted]" (and without a fold
    that covered one, dropped with it), so it cannot match, and this says why.
    """

    call: ModelCall
    rendered: Rendered
    matches: bool
    redacted: tuple[int, ...] = ()


class Caretaker(Protocol):
    """The lifecycle as an operator drives it (``Lifecycle``)."""

    def hibernate(self, agent: Agent, done: asyncio.Future[bool] | None = None) -> bool: ...

    def evict(self, agent: Agent) -> bool: ...

    def sweep(self, now: float) -> tuple[int, int]: ...


class Supervised(Protocol):
    """The supervisor as the stats count it and an operator starts an agent (``Supervisor``)."""

    def ensure_running(self, agent: Agent) -> None: ...

    @property
    def tasks(self) -> Collection[asyncio.Task[Any]]: ...


class Administered(Stored, Protocol):
    """What admin needs of the runtime beyond its parts: what only exists while it runs
    (the cluster gate, the embedding worker), profiles and derived memory."""

    @property
    def gate(self) -> Gate | None: ...

    @property
    def embedding(self) -> EmbeddingWorker | None: ...

    def profile_for(self, conversation_id: str) -> Profile: ...

    def agent(self, conversation_id: str) -> Agent: ...

    async def stop_agents(self) -> None: ...

    async def memory(self, conversation_id: str, *, max_lines: int = 40) -> MemoryView: ...


class Admin:
    __slots__ = (
        "_admission", "_counters", "_host", "_lifecycle", "_registry", "_runtime", "_supervisor",
        "_watchers",
    )

    def __init__(
        self,
        *,
        registry: Registry,
        counters: Counters,
        watchers: Watchers,
        host: AgentHost,
        admission: Admission,
        supervisor: Supervised,
        lifecycle: Caretaker,
        runtime: Administered,
    ) -> None:
        self._registry = registry
        self._counters = counters
        self._watchers = watchers
        self._host = host
        self._admission = admission
        self._supervisor = supervisor
        self._lifecycle = lifecycle
        self._runtime = runtime

    def _info(self, agent: Agent, *, detail: bool) -> AgentInfo:
        now = time.monotonic()
        ws = agent.ws
        return AgentInfo(
            conversation_id=agent.id,
            state=str(agent.state),
            hibernated=agent.hibernated,
            live=True,
            idle_seconds=None if agent.busy else max(0.0, now - agent.last_active),
            mailbox_depth=agent.mailbox_depth(),
            restarts=agent.restarts,
            working_set_tokens=agent.ws_tokens,
            working_set_bytes=agent.ws_bytes,
            head=agent.head if agent.head >= 0 else None,
            checkpoint_position=(
                ws.checkpoint.position if ws is not None and ws.checkpoint is not None else None
            ) if detail else None,
            tail_length=len(ws.tail) if ws is not None and detail else None,
            turn=agent.turn,
            pending_calls=agent.pending,
            last_error=agent.last_error,
            parked_cause=agent.parked_cause,
            postponed=len(agent.postponed) if agent.postponed else 0,
        )

    async def agents(self, state: str | AgentState | None = None) -> list[AgentInfo]:
        """Every agent in memory (optionally in one state, or ``"hibernated"``), from memory.

        Evicted agents are not in memory: find the ones waiting on an outside
        answer with :meth:`pending`.
        """
        wanted = None if state is None else str(state)
        return [
            self._info(agent, detail=False)
            for agent in self._registry
            if wanted is None or str(agent.state) == wanted
            or (wanted == "hibernated" and agent.hibernated)
        ]

    async def inspect(self, conversation_id: str) -> AgentInfo:
        """One agent in detail; an evicted one is read from the store, not revived."""
        check_id(conversation_id)
        agent = self._registry.get(conversation_id)
        if agent is not None:
            return self._info(agent, detail=True)
        resume = await self._runtime.store.resume(conversation_id)
        if resume.head is None:
            raise UnknownConversation(conversation_id)
        restored = restore([presented(e) for e in resume.events])
        restarts = 0
        for event in resume.events:
            if isinstance(event.body, Parked):
                restarts = event.body.restarts
            elif isinstance(event.body, Unparked):
                restarts = 0
        return AgentInfo(
            conversation_id=conversation_id,
            state=str(AgentState.EVICTED),
            hibernated=False,
            live=False,
            idle_seconds=None,
            mailbox_depth=0,
            restarts=restarts,
            working_set_tokens=0,
            working_set_bytes=0,
            head=resume.head,
            checkpoint_position=(
                resume.checkpoint.position if resume.checkpoint is not None else None
            ),
            tail_length=len(resume.events),
            turn=restored.turn,
            pending_calls=restored.pending,
            parked_cause=restored.parked_cause,
        )

    async def stats(self) -> RuntimeStats:
        """Counts by state and the runtime's counters, from memory."""
        registry = self._registry
        states = registry.states()
        hibernated, with_ws = len(registry.dormant), 0
        for agent in registry.held():
            if agent.ws is not None:
                with_ws += 1
            elif agent.hibernated:
                hibernated += 1
        c = self._counters
        samples = list(c.revival_seconds)
        p50 = percentile(samples, 50)
        p99 = percentile(samples, 99)
        wait50, wait99 = self._admission.wait_percentiles()
        return RuntimeStats(
            states=states,
            live=len(registry),
            hibernated=hibernated,
            with_working_set=with_ws,
            tasks=len(self._supervisor.tasks),
            working_set_bytes=self._host.ws_total,
            activations=c.activations,
            revivals=c.revivals,
            hibernations=c.hibernations,
            evictions=c.evictions,
            crashes=c.crashes,
            restarts=c.restarts,
            parks=c.parks,
            store_failures=c.store_failures,
            queued=len(self._admission),
            queue_wait_p50_ms=None if wait50 is None else wait50 * 1000,
            queue_wait_p99_ms=None if wait99 is None else wait99 * 1000,
            abandoned=c.abandoned,
            revival_p50_ms=None if p50 is None else p50 * 1000,
            revival_p99_ms=None if p99 is None else p99 * 1000,
            consolidation_failures=c.consolidation_failures,
            retention_deletions=c.retention_deletions,
        )

    def watch(self, bound: int = 10_000) -> Watcher:
        """Lifecycle transitions from now on (a slow watcher drops the oldest).

        Use as ``with rt.admin.watch() as w: async for t in w: ...``; it is
        registered at once, so nothing between this call and the first read is lost.
        """
        return self._watchers.watch(bound)

    async def hibernate(self, conversation_id: str) -> bool:
        """Drop an idle agent's working set now. False if it is busy or not in memory."""
        agent = self._registry.get(conversation_id)
        if agent is None:
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not self._lifecycle.hibernate(agent, done):
            return False
        return await done  # the agent does it when it takes the request

    async def evict(self, conversation_id: str) -> bool:
        """Forget an idle agent now (the log keeps everything). False if it cannot be."""
        agent = self._registry.get(conversation_id)
        if agent is None:
            return False
        lifecycle = self._lifecycle
        if agent.ws is not None and not lifecycle.hibernate(agent) and agent.busy:
            return False
        evicted = lifecycle.evict(agent)
        if evicted and self._admission:
            self._admission.admit()  # the slot goes to a conversation waiting for one
        return evicted

    async def sweep(self, now: float | None = None) -> tuple[int, int]:
        """Run the lifecycle sweep now, as if the clock read ``now`` (time.monotonic()).

        Returns (hibernated, evicted). The runtime sweeps on its own every
        ``sweep_every`` seconds; this is for operators and tests.
        """
        return self._lifecycle.sweep(time.monotonic() if now is None else now)

    async def cluster(self) -> ClusterView | None:
        """On a cluster node: its shards and their epochs, the members and the lease table,
        read from the database now. None when the runtime is not a node of a cluster."""
        gate = self._runtime.gate
        return None if gate is None else await gate.view()

    # Routing for an HTTP layer in front of a cluster node (torpor.serve.proxy): the Python
    # API raises NotOwner at once and leaves waiting to the caller; these let it wait.
    async def route(self, conversation_id: str) -> ShardRoute | None:
        """On a cluster node: where a request for the conversation goes now, by this node's
        lease cache (no database read). None when the runtime is not a node of a cluster."""
        check_id(conversation_id)
        gate = self._runtime.gate
        return None if gate is None else gate.route(conversation_id)

    async def settled(self, conversation_id: str) -> ShardRoute | None:
        """On a cluster node, for a conversation whose shard is in hand-off through this
        node (``NotOwner.moving``): its route once the lease has landed (served here, or
        held by the new owner), or as it stands after about the hand-off deadline plus two
        lease refreshes."""
        check_id(conversation_id)
        gate = self._runtime.gate
        return None if gate is None else await gate.settled(conversation_id)

    async def moved(self, conversation_id: str, owner: str) -> ShardRoute | None:
        """On a cluster node: returns once ``owner`` stopped renewing its membership and
        this node's lease cache no longer sends the conversation there (its lease moved);
        waits until cancelled otherwise."""
        check_id(conversation_id)
        gate = self._runtime.gate
        return None if gate is None else await gate.moved(conversation_id, owner)

    async def stop_turns(self) -> None:
        """End every turn now, as leaving the runtime does: an open turn logs
        ``Aborted("shutdown")`` (turns postponed behind it too), followers end after what
        they hold, and no turn starts any more. The runtime stays entered (reads work) until
        it is left. For an HTTP layer that drains a runtime its host entered: at the end of
        its grace, the streams it serves send these aborts before they close (a server
        leaves the host's lifespan only once they have closed)."""
        await self._runtime.stop_agents()

    async def depart(self, deadline: float | None = None) -> bool:
        """On a cluster node: begin leaving the cluster now. The node serves nothing more
        (requests for its shards get ``NotOwner`` with ``moving`` set), hands every shard
        off as its turns end (up to ``deadline`` seconds, ``NodeConfig.handoff_deadline``
        by default) and takes none; the runtime's exit completes the leave. An HTTP layer
        draining before it stops calls this first, with its drain's grace, so the shards
        move while it drains. False on a single node."""
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float)
            or not 0 <= deadline < float("inf")
        ):
            raise InvalidInput("deadline", f"must be seconds >= 0, got {deadline!r}")
        gate = self._runtime.gate
        if gate is None:
            return False
        gate.depart(deadline)
        return True

    async def branches(self, conversation_id: str) -> Branch:
        """The sub-agent tree around a conversation: the call it answers (if it is a
        child) and its children, recursively, with each task's status. From the logs;
        wakes no agent."""
        check_id(conversation_id)
        return await branch_tree(self._runtime.store, conversation_id)

    async def embed(self) -> EmbeddingStats | None:
        """Run a pass of the embedding worker now (hybrid recall) and return its stats.

        None when the runtime has no embedder. The worker runs on its own every
        ``embed_interval`` seconds; this is for operators, tests and benchmarks
        that need the vectors caught up with the log at a known moment.
        """
        worker = self._runtime.embedding
        if worker is None:
            return None
        await worker.catch_up()
        return worker.stats()

    async def pending(
        self, limit: int = 100, after: str | None = None
    ) -> list[PendingApproval]:
        """Every conversation waiting on an outside answer, evicted or not, by id.

        From the store's index of open suspensions: never wakes an agent and
        never scans the log. Page with ``after=page[-1].conversation_id``.
        """
        if type(limit) is not int or not 1 <= limit <= 10_000:
            raise InvalidInput("limit", f"must be an int from 1 to 10000, got {limit!r}")
        if after is not None:
            check_id(after, "after")
        return await self._runtime.store.pending(after=after, limit=limit)

    async def schedules(self, limit: int = 100, after: str | None = None) -> SchedulePage:
        """Every conversation's pending schedules, by id (creation order), from the store:
        never wakes an agent. ``after``: the page's ``next`` (a schedule id)."""
        if type(limit) is not int or not 1 <= limit <= 10_000:
            raise InvalidInput("limit", f"must be an int from 1 to 10000, got {limit!r}")
        if after is not None:
            check_id(after, "after")
        found = await self._runtime.store.list_schedules(after=after, limit=limit + 1)
        more = len(found) > limit
        page = tuple(found[:limit])
        return SchedulePage(page, page[-1].id if more else None)

    async def unpark(self, conversation_id: str) -> bool:
        """Let a parked agent run again (logged as ``Unparked``). False if it was not parked.

        Asked of the agent's actor, which logs it and revives from the log."""
        check_id(conversation_id)
        agent = self._registry.get(conversation_id)
        if agent is not None and agent.state is not AgentState.PARKED:
            return False
        if agent is None:
            resume = await self._runtime.store.resume(conversation_id)
            if restore(resume.events).state is not AgentState.PARKED:
                return False
            agent = self._runtime.agent(conversation_id)  # revives parked, then unparks
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        agent.post(UnparkRequest(done))
        self._supervisor.ensure_running(agent)
        return await done

    async def rendered(self, conversation_id: str, call: int | ModelCall = -1) -> RenderedCall:
        """Rebuild exactly what a model call was sent (from the log and its recipe)."""
        check_id(conversation_id)
        if isinstance(call, int):
            calls = await self._runtime.store.model_calls(conversation_id, limit=1_000_000)
            if not calls:
                raise UnknownConversation(f"{conversation_id}: no model calls recorded")
            try:
                record = calls[call]
            except IndexError:
                raise InvalidInput(
                    "call", f"{conversation_id}: {len(calls)} model calls recorded, no #{call}"
                ) from None
        else:
            record = call
        if record.purpose != "turn":  # a summarizer's prompt is its own, not the context
            raise InvalidInput("call", f"{conversation_id}: that call is a {record.purpose!r} "
                                       "call, not one that answered the conversation")
        try:
            recipe = decode_recipe(record.recipe)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # the store's damage
            raise CorruptEvent(
                conversation_id, -1, f"recipe of model call of turn {record.turn}: {exc}"
            ) from None
        profile = self._runtime.profile_for(conversation_id)
        store = self._runtime.store
        redacted = await redacted_since(store, conversation_id, recipe, record.created_at)
        rendered = await rebuild_rendered(
            store,
            conversation_id,
            recipe,
            profile.config.system_prompt,
            profile.policy,
            profile.specs,
            redacted=bool(redacted),
        )
        return RenderedCall(record, rendered, rendered.hash == record.rendered_hash, redacted)

    async def memory(self, conversation_id: str, *, max_lines: int = 40) -> MemoryView:
        """A conversation's derived memory (items, ledger, digest), from the store alone:
        never wakes the agent."""
        return await self._runtime.memory(conversation_id, max_lines=max_lines)
