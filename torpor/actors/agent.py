"""The agent record: everything one conversation keeps in memory, and nothing more.

A hibernated agent keeps only this record (ids, positions, counters, no task,
no working set, no mailbox), so it must stay small: ``__slots__``, lazily
created parts, and no per-agent timers. Once nothing but the registry refers
to it, not even the record is kept: its fields become a row of the runtime's
dormant table (:mod:`torpor.runtime.dormant`), which rebuilds it on demand. A
new field must be listed there (a test checks that every slot is).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from torpor.actors.mailbox import Mailbox, Message, RedactRequest, SendRequest
from torpor.actors.state import REPORTED, AgentState, transition
from torpor.actors.write_lock import WriteLock

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from contextlib import AbstractAsyncContextManager

    import anyio

    from torpor.actors.config import AgentConfig
    from torpor.actors.observe import Observers
    from torpor.actors.stream import Follower, StreamHub
    from torpor.actors.tools import Toolbox
    from torpor.actors.turn import Turn
    from torpor.actors.watchdog import ModelWatchdog
    from torpor.compaction.fusion import HybridRecall
    from torpor.compaction.policy import CompactionPolicy
    from torpor.compaction.working_set import WorkingSet
    from torpor.events import Event
    from torpor.llm.protocol import Model, ToolSpec
    from torpor.mcp.view import ToolView
    from torpor.store.protocol import EventStore

__all__ = ["RECENT_EVENTS", "Agent", "Host", "Profile", "Waiting"]

RECENT_EVENTS = 16
"""How many of its latest events a live agent keeps for followers (a turn logs a few)."""


class Waiting:
    """A postponed turn: its user message is logged; it runs when the open turn ends."""

    __slots__ = ("event", "hub", "turn")

    def __init__(self, event: Event, turn: Turn, hub: StreamHub) -> None:
        self.event = event
        self.turn = turn
        self.hub = hub


class Profile:
    """An AgentConfig made ready to run: its policy, toolbox and tool specs (shared by agents).

    ``mcp``: its MCP servers' tools (None without servers): their specs change with the
    servers' tool lists, so a model call asks it for the specs instead of using ``specs``.
    """

    __slots__ = ("config", "mcp", "policy", "specs", "toolbox")

    def __init__(
        self,
        config: AgentConfig,
        policy: CompactionPolicy,
        toolbox: Toolbox,
        specs: tuple[ToolSpec, ...],
        mcp: ToolView | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.toolbox = toolbox
        self.specs = specs
        self.mcp = mcp


class Host(Protocol):
    """What an agent needs from the runtime that owns it (implemented in torpor.runtime)."""

    model: Model
    log: Any
    hybrid: HybridRecall | None  # recall fused with vectors, when the runtime has an embedder
    watchdog: ModelWatchdog  # ends model streams that stall (its task is the runtime's)
    observers: Observers  # metrics, traces: told of turns, model and tool calls, folds
    schedule_now: Callable[[], int]  # the schedules' clock, epoch ms (the schedule tool)
    poke_schedules: Callable[[int], None] | None  # the timer: a schedule due then was added

    @property
    def store(self) -> EventStore: ...

    def revival_slot(self) -> AbstractAsyncContextManager[None]: ...

    def on_state(self, agent: Agent, old: AgentState, new: AgentState) -> None: ...

    def on_revived(self, agent: Agent, seconds: float) -> None: ...

    def on_idle(self, agent: Agent) -> None: ...

    def on_hibernated(self, agent: Agent) -> None:
        """The agent dropped its caches when asked to (its task ends next)."""
        ...

    def on_dropped(self, agent: Agent) -> None:
        """The agent's working set is gone (a crash): it no longer counts in memory."""
        ...

    @property
    def restart_window(self) -> float:
        """Seconds over which crashes count towards parking."""
        ...

    @property
    def draining(self) -> bool:
        """The runtime is stopping (not a shard moving away): its agents end their turns."""
        ...

    def followers(self, conversation_id: str) -> list[Follower] | None:
        """The conversation's followers (``Runtime.subscribe``), None when it has none."""
        ...

    def publish(self, agent: Agent, events: list[Event]) -> None:
        """Hand events ``agent`` just logged to its conversation's followers."""
        ...

    def abandon(self, task: asyncio.Task[Any], what: str) -> None:
        """Take over a task that ignored cancellation past its deadline."""
        ...


class Agent:
    """One conversation's actor state. Owned by the runtime's registry and supervisor."""

    __slots__ = (
        "accounted",
        "calibration",
        "calls",
        "cancellable",
        "cancels",
        "compact_requested",
        "crash_times",
        "current",
        "cycle",
        "head",
        "hub",
        "id",
        "last_active",
        "last_error",
        "lock",
        "mailbox",
        "numbered",
        "parked_cause",
        "pending",
        "postponed",
        "profile",
        "recent",
        "redactions",
        "restarts",
        "scope",
        "state",
        "store_failures",
        "taken",
        "task",
        "topic",
        "turn",
        "turn_task",
        "unlogged",
        "waiter",
        "ws",
        "ws_bytes",
        "ws_tokens",
    )

    def __init__(self, conversation_id: str, profile: Profile) -> None:
        self.id = conversation_id
        self.profile = profile
        self.state = AgentState.REVIVING
        self.ws: WorkingSet | None = None
        self.mailbox: Mailbox | None = None
        # The request the actor took from its mailbox and has not answered yet: whoever
        # stops the task (shutdown, a shard moving away) must answer it, not only the
        # mailbox (a cancel breaks through the actor's shields).
        self.taken: Message | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        # The open turn's task: a child of the actor's, which keeps reading its mailbox
        # (sends, cancels, answers) while the turn runs.
        self.turn_task: asyncio.Task[None] | None = None
        self.hub: StreamHub | None = None
        self.current: Turn | None = None
        self.scope: anyio.CancelScope | None = None
        self.last_active = time.monotonic()
        self.head = -1  # last logged position; -1: empty conversation
        self.turn = 0
        # The highest turn number in the log: a postponed turn a drain ended before it ran
        # keeps its number, above the open turn's (the next message is numbered above both).
        self.numbered = 0
        self.cycle = 0  # compaction cycles so far (checkpoints written)
        self.calls = 0  # model calls in the current turn
        self.topic: str | None = None  # the last model call's topic label (its anatomy)
        self.pending: tuple[str, ...] = ()  # tool call ids awaiting an outside answer
        self.restarts = 0
        self.crash_times: tuple[float, ...] = ()
        self.last_error: str | None = None
        self.parked_cause: str | None = None
        self.compact_requested = False
        # Redactions taken while a turn ran: done when it ends (actors.actor).
        self.redactions: list[RedactRequest] | None = None
        self.calibration = 1.0  # provider-reported / estimated prompt tokens, last seen
        self.ws_tokens = 0
        self.ws_bytes = 0
        self.accounted = 0  # ws_bytes as last counted into the runtime's memory total
        # Kept while live only (dropped on hibernation): the actor logs a message sent
        # mid-turn while the turn's task appends, so appends that expect our head queue.
        self.lock: WriteLock | None = None
        self.postponed: list[Waiting] | None = None  # turns logged behind the open one
        self.cancels: list[asyncio.Future[bool]] | None = None  # callers awaiting a cancel
        self.cancellable = False  # the turn is at a point a cancel may interrupt
        self.store_failures = 0  # consecutive StoreUnavailable restarts (backoff, not crashes)
        # Text a dead stream delivered that no logged event holds yet: the Aborted owed for
        # its turn carries it, and until then it is the text in flight for new followers.
        self.unlogged = ""
        # The latest events logged while live, positions consecutive up to ``head``: a
        # follower starting near the head (a POST streaming its own turn) replays them from
        # here instead of reading the log back. Dropped with the working set.
        self.recent: list[Event] | None = None

    # -- state ---------------------------------------------------------------
    @property
    def hibernated(self) -> bool:
        return self.ws is None and self.state in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED)

    @property
    def shown(self) -> AgentState:
        """The state reported for this agent: ``hibernated`` while its caches are dropped."""
        return AgentState.HIBERNATED if self.hibernated else self.state

    def set_state(self, host: Host, new: AgentState) -> None:
        """The one way an agent's state changes (by its own task): checked, then reported."""
        old = self.shown
        if new is old and new is not AgentState.STREAMING:
            return
        self.state = transition(self.id, old, new)
        host.on_state(self, old, new)

    def report(self, host: Host, new: AgentState) -> None:
        """Report a state the record never holds (hibernated, evicted, queued), checked."""
        assert new in REPORTED
        old = self.shown
        if new is not old:
            host.on_state(self, old, transition(self.id, old, new))

    @property
    def busy(self) -> bool:
        """Mid-turn or with input waiting: never hibernated or evicted in this condition."""
        if self.state in (AgentState.STREAMING, AgentState.RUNNING_TOOLS, AgentState.REVIVING):
            return True
        if self.turn_running or self.taken is not None:
            return True
        mailbox = self.mailbox
        if mailbox is not None and mailbox.work:
            return True
        lock = self.lock
        if lock is not None and lock.locked():  # a message is being logged right now
            return True
        # Postponed turns behind a suspension: hibernating is fine (they are in the log),
        # but the callers' Turn handles live on this record, so it is not evicted.
        return self.runnable_postponed()

    @property
    def turn_running(self) -> bool:
        """A turn's task runs (one that ended is collected by the actor next)."""
        task = self.turn_task
        return task is not None and not task.done()

    @property
    def evictable(self) -> bool:
        return not self.busy and not self.postponed

    def runnable_postponed(self) -> bool:
        """Postponed turns that could run now (not waiting behind a suspension)."""
        return bool(self.postponed) and self.state is not AgentState.SUSPENDED

    def last_turn(self) -> int:
        """The highest turn number logged (postponed turns included)."""
        postponed = self.postponed
        last = postponed[-1].event.turn if postponed else self.turn
        return last if last >= self.numbered else self.numbered

    # -- recent events -----------------------------------------------------------
    def remember(self, events: Sequence[Event]) -> None:
        """Keep ``events`` (just logged, at the head) among the recent ones."""
        recent = self.recent
        if recent and recent[-1].position + 1 == events[0].position:
            recent.extend(events)
            if len(recent) > RECENT_EVENTS:
                del recent[:-RECENT_EVENTS]
        else:  # the first since the working set was read, or a gap: start again from these
            self.recent = list(events[-RECENT_EVENTS:])

    def logged_after(self, after: int) -> list[Event] | None:
        """The events logged after position ``after`` up to ``head``, from memory (the
        agent is live); None when memory does not hold every one of them."""
        if after >= self.head:
            return []
        recent = self.recent
        if not recent or recent[0].position > after + 1 or recent[-1].position != self.head:
            return None
        return recent[after + 1 - recent[0].position:]

    # -- mailbox ---------------------------------------------------------------
    def post(self, message: Message) -> None:
        if self.mailbox is None:
            self.mailbox = Mailbox()
        self.mailbox.put(message)
        self.wake()

    def wake(self, _: object = None) -> None:
        """Resume the actor if it waits for mail (also a turn task's done callback)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def next_message(self) -> Message | None:
        mailbox = self.mailbox
        if mailbox is None:
            return None
        message = mailbox.take()
        if message is not None and not len(mailbox):
            self.mailbox = None  # an empty deque is ~600 bytes: not kept while idle
        return message

    def mailbox_depth(self) -> int:
        return 0 if self.mailbox is None else len(self.mailbox)

    def has_work(self) -> bool:
        """Mail that needs the working set (anything but a request to hibernate)."""
        return self.mailbox is not None and self.mailbox.work > 0

    def queued_in_mailbox(self) -> int:
        """User messages in the mailbox (not yet logged)."""
        return 0 if self.mailbox is None else self.mailbox.sends

    def queued_sends(self) -> int:
        """User messages not yet run: in the mailbox, being logged, or logged and postponed."""
        queued = 0 if self.mailbox is None else self.mailbox.sends
        queued += isinstance(self.taken, SendRequest)
        return queued + (len(self.postponed) if self.postponed else 0)
