"""Admission: the live-agent cap holds in an activation storm.

When ``max_live_agents`` agents are in memory and none of them is idle enough
to give up its slot, a message for another conversation is still made durable
at once (its sender's ``send`` returns as usual) but its conversation waits
here, in arrival order, holding no working set and no task: only its record
and the handles of its logged, postponed turns. A slot opens whenever an idle
agent is hibernated and evicted (least recently used first) or leaves by
itself; the head of the queue then revives and runs its turns.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from torpor.actors.aborts import report_abort
from torpor.actors.actor import replayed_turn
from torpor.actors.agent import Agent, Waiting
from torpor.actors.state import AgentState
from torpor.actors.stream import StreamHub
from torpor.actors.turn import Turn
from torpor.actors.write_lock import WriteLock
from torpor.errors import AgentParked, TurnAborted
from torpor.events import Event, Parked, Unparked, UserMessage, aborted_body
from torpor.runtime.stats import Samples, percentile

if TYPE_CHECKING:
    from torpor.actors.agent import Profile
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.ports import Starter
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters

__all__ = ["Admission", "Admitting"]


class Admitting(Protocol):
    """What admission needs of the runtime: room under the cap, and a newcomer's profile."""

    def shed_agents(self, *, keep: Agent | None, below: int | None = None) -> None: ...

    def profile_for(self, conversation_id: str) -> Profile: ...


class Admission:
    __slots__ = (
        "_closed", "_config", "_counters", "_host", "_registry", "_runtime", "_supervisor",
        "admitted", "queue", "since", "waits",
    )

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        host: AgentHost,
        supervisor: Starter,
        runtime: Admitting,
    ) -> None:
        self._closed: BaseException | None = None  # the runtime stopped: with this error
        self._config = config
        self._registry = registry
        self._counters = counters
        self._host = host
        self._supervisor = supervisor
        self._runtime = runtime
        self.queue: OrderedDict[str, Agent] = OrderedDict()  # arrival order
        self.since: dict[str, float] = {}  # monotonic time each entered the queue
        self.waits = Samples(4096)  # seconds from queue to slot
        self.admitted = 0

    def __len__(self) -> int:
        return len(self.queue)

    def queued(self) -> int:
        return len(self.queue)

    def must_wait(self, conversation_id: str) -> bool:
        """Whether a conversation not in memory has to queue for a slot now."""
        if conversation_id in self.queue:
            return True
        if self.queue:
            self.admit()  # free slots go to those already waiting first
            if self.queue:
                return True  # fair: nobody overtakes them
        cap = self._config.max_live_agents
        if len(self._registry) >= cap:
            self._runtime.shed_agents(keep=None, below=cap)
        return len(self._registry) >= cap

    def waiting(self, conversation_id: str) -> Agent:
        """The queued record of a conversation (made on its first message)."""
        agent = self.queue.get(conversation_id)
        if agent is None:
            agent = Agent(conversation_id, self._runtime.profile_for(conversation_id))
            self.queue[conversation_id] = agent
            self.since[conversation_id] = time.monotonic()
            self._counters.activations += 1
        return agent

    def take(self, conversation_id: str) -> Agent | None:
        """Out of the queue at once (a resolve or cancel for it must not wait)."""
        agent = self.queue.pop(conversation_id, None)
        if agent is not None:
            self._admit(agent)
        return agent

    def drop(self, conversation_id: str) -> Agent | None:
        """Out of the queue for good, not admitted (its shard moved to another node)."""
        self.since.pop(conversation_id, None)
        return self.queue.pop(conversation_id, None)

    def admit(self) -> None:
        """Give free slots to the queue's head, evicting idle agents to make them."""
        registry = self._registry
        cap = self._config.max_live_agents
        while self.queue:
            if len(registry) >= cap:
                self._runtime.shed_agents(keep=None, below=cap)
                if len(registry) >= cap:
                    return
            _, agent = self.queue.popitem(last=False)
            self._admit(agent)

    def _admit(self, agent: Agent) -> None:
        started = self.since.pop(agent.id, None)
        if started is not None:
            self.waits.append(time.monotonic() - started)
        self.admitted += 1
        self._registry.add(agent)
        self._host.transition(agent, AgentState.QUEUED, agent.state)
        self._supervisor.ensure_running(agent)

    def wait_percentiles(self) -> tuple[float | None, float | None]:
        samples = list(self.waits)
        return percentile(samples, 50), percentile(samples, 99)

    async def send(
        self, agent: Agent, text: str, key: str | None, metadata: dict[str, Any] | None = None,
        origin: object | None = None,
    ) -> Turn | None:
        """Log a message for a queued conversation; its turn runs once it has a slot.

        A queued conversation has no actor yet: until it is let in, this queue writes
        its record, under the record's write lock, which its actor's revival takes
        first. None: it was let in meanwhile (send to its actor instead).
        """
        host = self._host
        store = host.store
        if agent.lock is None:
            agent.lock = WriteLock()
        with anyio.CancelScope(shield=True):  # once written, it must be answered
            async with agent.lock:
                if self.queue.get(agent.id) is not agent:
                    return None  # let in: its actor is the writer now
                if agent.head < 0 and agent.postponed is None:
                    # Where the conversation stands, without reading its working set:
                    # postponed input sits near the head, within the mailbox bound.
                    # Under the revival cap, so a storm holds few such reads at once.
                    async with host.revival_slot():
                        recent = await store.page_backward(
                            agent.id, None, self._config.mailbox_bound + 2
                        )
                    if recent:
                        agent.head = recent[0].position
                        agent.turn = max(e.turn for e in recent)
                        agent.parked_cause = _parked(recent)
                if agent.parked_cause is not None:  # a parked conversation takes no input
                    raise AgentParked(agent.id, agent.parked_cause)
                number = agent.last_turn() + 1
                events = await store.append_events(
                    agent.id, [UserMessage(text, metadata)], turn=number,
                    expect_head=agent.head, key=key,
                )
                event = events[0]
                if event.turn != number:  # an idempotent retry of an earlier send
                    return await replayed_turn(agent, host, event.position, event.turn)
                agent.head = event.position
                host.publish(agent, events)
                hub = StreamHub(host.followers(agent.id))
                turn = Turn(agent.id, number, event.position, hub.join(), postponed=True)
                turn.origin = origin
                if self._closed is not None or (
                    self.queue.get(agent.id) is not agent
                    and self._registry.agents.get(agent.id) is not agent
                ):
                    # Closed (or moved away) while it was written: nobody will run it here.
                    # (Let in meanwhile, its revival waits for this lock and adopts it.)
                    await self._settle_left(agent, turn, hub, number)
                    return turn
                if agent.postponed is None:
                    agent.postponed = []
                agent.postponed.append(Waiting(event, turn, hub))
        return turn

    async def _settle_left(self, agent: Agent, turn: Turn, hub: StreamHub, number: int) -> None:
        """A turn logged for a record the queue let go of meanwhile, not to the registry."""
        error = self._closed or TurnAborted(
            "interrupted", "", "the conversation left this runtime before its turn ran"
        )
        if self._closed is not None:  # the runtime stops: the log says so, as the caller
            body = aborted_body("shutdown", detail="runtime stopped before this postponed "
                                "turn ran")
            try:
                await self._host.store.append_events(
                    agent.id, [body], turn=number, expect_head=agent.head,
                )
            except Exception:  # not logged: the next run reports it interrupted
                pass
            else:
                report_abort(self._host.log, self._host.observers, agent.id, number, body)
        turn._fail(error)
        hub.close(error)

    def close(self, error: BaseException) -> None:
        self._closed = error
        for agent in self.queue.values():
            for waiting in agent.postponed or ():
                waiting.turn._fail(error)
            agent.postponed = None
        self.queue.clear()
        self.since.clear()


def _parked(recent: list[Event]) -> str | None:
    """The parking cause in force at the newest of ``recent`` (newest first), if any."""
    for event in recent:
        if isinstance(event.body, Unparked):
            return None
        if isinstance(event.body, Parked):
            return event.body.cause
    return None
