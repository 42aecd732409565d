"""Sub-agents: a child conversation that answers a parent's suspended tool call.

``Runtime.spawn(parent, call_id, task=..., agent=...)`` links the call to a
child conversation and gives it the task; the child's final answer becomes the
call's result in the parent (``Runtime.resolve``). The link is durable, a
:class:`~torpor.events.Spawned` event in both logs, written in this order:

1. the child's log: ``Spawned`` with the task, as its first event (idempotent);
2. the parent's log: ``Spawned`` in its open turn, written by the parent's own
   actor, which checks that it waits for ``call_id`` (a call links once);
3. the task, as the child's first user message (idempotent by key).

Each link has a watcher task (owned here, cancelled and awaited when the
runtime stops) that follows the child's log and resolves the parent when the
child answers (``is_error`` when the child's turn failed). On start, the
runtime finds the links whose parent call is still pending (from the store's
pending-calls index, never a log scan) and watches them again: a child that
finished while nobody watched resolves its parent, one whose turn died with
the process is told to continue, and one never given its task gets it. The
parent's pending check makes the resolution happen exactly once.

Deletes (:mod:`torpor.runtime.erase`): a deleted child (its log gone, or its stream
ended by its delete) answers the parent's call with an error result saying so, so
the parent's turn never waits for it forever; a deleted parent takes its children
with it, and the delete cancels their watchers (nothing is left to answer).

A child is a conversation like any other: revivable, searchable, inspectable,
with its own lifecycle, so it outlives the parent's eviction (resolving revives
the parent). ``agent=`` is the child's configuration for the life of this
runtime; after a restart it comes from ``agent_for`` (the child id is
``"{parent}/{call_id}"`` unless given), or the default.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from torpor.actors.branch import link_key
from torpor.actors.config import AgentConfig
from torpor.actors.mailbox import SpawnRequest
from torpor.errors import (
    AgentParked,
    ConversationDeleted,
    InvalidInput,
    NotOwner,
    StoreUnavailable,
    UnknownCall,
    UnknownConversation,
)
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Resolved,
    Spawned,
    Suspended,
    ToolResult,
    UserMessage,
)

if TYPE_CHECKING:
    from torpor.actors.stream import Follower
    from torpor.actors.turn import Turn
    from torpor.runtime.ports import Conversations, Gate, Starter
    from torpor.runtime.registry import Registry
    from torpor.store.protocol import EventStore

__all__ = ["CONTINUE", "Branch", "Branches", "Client", "branch_tree"]

CONTINUE = (
    "[The runtime restarted while you were working on your task. Continue it from where "
    "the log shows you stopped, and finish with your answer.]"
)
_FAILED = frozenset({"cancelled", "model_error", "step_limit", "crashed"})
_RETRY_SECONDS = 1.0  # a store that cannot write: try the resolution again after this

Status = Literal["untasked", "running", "waiting", "stopped", "done", "failed"]


class Branch(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation in a tree of sub-agents (``Runtime.admin.branches``)."""

    conversation_id: str
    parent: str | None  # the conversation whose call this one answers (None: a root)
    call_id: str | None
    status: str  # untasked, running, waiting, stopped, done, failed ("" for a root)
    children: tuple[Branch, ...] = ()


class _Progress:
    """What a child's log says so far about its task, one event at a time."""

    __slots__ = ("answer", "position", "status", "waiting")

    def __init__(self) -> None:
        self.status: Status = "untasked"
        self.waiting: set[str] = set()
        self.answer = ""
        self.position = -1  # of the answer (or the abort)

    def see(self, event: Event) -> bool:
        """Take one event; True once the task has an outcome (done or failed)."""
        body = event.body
        if self.status in ("done", "failed"):
            return True
        if isinstance(body, UserMessage | ToolResult):
            self.status = "waiting" if self.waiting else "running"
        elif isinstance(body, AssistantMessage):
            if not body.tool_calls and self.status != "untasked":
                self.status, self.answer, self.position = "done", body.text, event.position
                return True
            self.status = "running"
        elif isinstance(body, Suspended):
            self.waiting.update(body.call_ids)
            self.status = "waiting"
        elif isinstance(body, Resolved):
            self.waiting.discard(body.call_id)
            self.status = "waiting" if self.waiting else "running"
        elif isinstance(body, Aborted):
            self.waiting.clear()
            if body.reason in _FAILED:
                self.status, self.position = "failed", event.position
                self.answer = f"sub-agent failed ({body.reason})" + (
                    f": {body.detail}" if body.detail else ""
                )
                return True
            self.status = "stopped"  # interrupted, shutdown: the process, not the task
        return False


class Client(Protocol):
    """The runtime's public API, which drives a child and answers its parent like any
    caller (``torpor.runtime.host.Runtime`` implements it)."""

    @property
    def store(self) -> EventStore: ...

    async def send(self, conversation_id: str, text: str, *, key: str | None = None) -> Turn: ...

    async def resolve(
        self, conversation_id: str, call_id: str, result: str, *, is_error: bool = False
    ) -> Turn | None: ...

    def subscribe(self, conversation_id: str, *, after: int | None = None) -> Follower: ...

    async def expand(self, conversation_id: str, start: int, end: int) -> list[Event]: ...


def _link_of(body: Body) -> Spawned | None:
    return body if isinstance(body, Spawned) else None


class Branches:
    """The runtime's sub-agent links: spawning, watching, recovering, the tree."""

    def __init__(
        self,
        client: Client,
        *,
        conversations: Conversations,
        registry: Registry,
        supervisor: Starter,
        log: Any,
    ) -> None:
        self._client = client
        self._conversations = conversations
        self._registry = registry
        self._supervisor = supervisor
        self._log = log
        self._running = False
        self._configs: dict[str, AgentConfig] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._parents: dict[str, str] = {}  # child -> the parent its watcher answers
        self._recoveries: set[asyncio.Task[None]] = set()

    # -- lifecycle (owned by the Runtime) -------------------------------------------
    def start(self, gate: Gate | None) -> None:
        """Watch again the links a previous run left open (in the background); on a
        cluster node (``gate``), those of the parents this node serves (the rest are
        recovered by their owners, and here when a shard is acquired: :meth:`recover`)."""
        self._running = True
        self.recover(None if gate is None else gate.serves)

    def recover(self, parents: Callable[[str], bool] | None) -> None:
        """Watch again the open links of the parents ``parents`` accepts (None: all)."""
        task = asyncio.get_running_loop().create_task(self._recover(parents))
        self._recoveries.add(task)
        task.add_done_callback(self._recovered)

    def _recovered(self, task: asyncio.Task[None]) -> None:
        self._recoveries.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("sub_agent_recovery_failed", error=repr(task.exception()))

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._recoveries, *self._watchers.values()]
        self._recoveries.clear()
        self._watchers.clear()
        self._parents.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def drop_watchers(self, parents: set[str]) -> None:
        """Cancel the watchers answering a call of one of ``parents`` (being deleted:
        there is nothing left to answer; their children go with them)."""
        for child, parent in list(self._parents.items()):
            if parent in parents:
                watcher = self._watchers.pop(child, None)
                del self._parents[child]
                self._configs.pop(child, None)
                if watcher is not None:
                    watcher.cancel()

    def config_for(self, conversation_id: str) -> AgentConfig | None:
        return self._configs.get(conversation_id)

    # -- spawn -------------------------------------------------------------------------
    async def spawn(
        self, parent: str, call_id: str, task: str, agent: AgentConfig | None, child: str
    ) -> str:
        client = self._client
        store = client.store
        first = await store.read_range(child, 0, 0)
        if first:
            link = _link_of(first[0].body)
            if link is None or (link.parent, link.call_id) != (parent, call_id):
                raise InvalidInput("child", f"{child!r} is already a conversation of its own")
        holder = await self._conversations.known(parent)
        if holder is None:
            raise UnknownConversation(parent)
        if holder.scope is not None:  # a turn runs: it waits for no call until it suspends
            raise UnknownCall(f"{parent}: not waiting for tool call {call_id!r}")
        if agent is not None:
            self._configs[child] = agent
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        holder.post(SpawnRequest(call_id, child, task, done))  # 1 and 2, by the parent's actor
        self._registry.unqueue(holder)
        self._supervisor.ensure_running(holder)
        try:
            linked = await done
        except BaseException:
            self._configs.pop(child, None)
            raise
        if linked != child:  # the call was linked before (to another id): that one answers
            self._configs.pop(child, None)
            child = linked
        await client.send(child, task, key=link_key("task", parent, call_id))  # 3. the task
        self._watch(parent, call_id, child, task, kick=False)
        return child

    def _watch(self, parent: str, call_id: str, child: str, task: str, *, kick: bool) -> None:
        if child in self._watchers or not self._running:
            return
        watcher = asyncio.get_running_loop().create_task(
            self._follow(parent, call_id, child, task, kick)
        )
        self._watchers[child] = watcher
        self._parents[child] = parent
        watcher.add_done_callback(lambda t: self._finished(child, t))

    def _finished(self, child: str, task: asyncio.Task[None]) -> None:
        if self._watchers.get(child) is task:
            del self._watchers[child]
            self._parents.pop(child, None)
        if not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, NotOwner):  # the shard moved: its new owner watches now
                self._log.debug("sub_agent_watch_moved", child=child, owner=error.owner)
            else:
                self._log.warning("sub_agent_watch_failed", child=child, error=repr(error))

    async def _follow(self, parent: str, call_id: str, child: str, task: str, kick: bool) -> None:
        """Follow the child's log until its task has an outcome; then resolve the parent."""
        client = self._client
        progress = _Progress()
        try:
            events = await client.store.read_since(child, 0)
            if not events:  # its first event (the link) comes before the parent's: deleted
                raise ConversationDeleted(child)
            done = any(progress.see(event) for event in events)
            if not done:
                head = events[-1].position
                async with client.subscribe(child, after=head) as follower:
                    if kick:
                        await self._kick(parent, call_id, child, task, progress, head)
                    async for item in follower:
                        if isinstance(item, Event) and progress.see(item):
                            done = True
                            break
        except ConversationDeleted:  # the child was deleted (not its parent: see the doc)
            progress.status, progress.answer = "failed", f"sub-agent {child!r} was deleted"
            done = True
        if done:
            await self._resolve(parent, call_id, child, progress)

    async def _kick(
        self, parent: str, call_id: str, child: str, task: str, progress: _Progress, head: int
    ) -> None:
        """After a restart: give the child its task, or tell it to continue a dead turn."""
        client = self._client
        live = self._registry.get(child)
        if progress.status == "untasked":
            await client.send(child, task, key=link_key("task", parent, call_id))
        elif progress.status == "stopped" or (
            progress.status == "running" and (live is None or live.ws is None)
        ):
            await client.send(child, CONTINUE, key=f"torpor-continue-{head}")

    async def _resolve(self, parent: str, call_id: str, child: str, progress: _Progress) -> None:
        client = self._client
        answer = progress.answer
        if progress.status == "done":
            events = await client.expand(child, progress.position, progress.position)
            body = events[0].body
            if isinstance(body, AssistantMessage):
                answer = body.text  # in full, even if it was clipped into an artifact
        while True:
            try:
                await client.resolve(parent, call_id, answer, is_error=progress.status == "failed")
            except UnknownCall:  # answered already (before a restart, or by hand): once only
                pass
            except UnknownConversation:  # the parent was deleted: its children went with it
                pass
            except StoreUnavailable:
                await asyncio.sleep(_RETRY_SECONDS)
                continue
            except AgentParked as exc:
                self._log.warning("sub_agent_parent_parked", parent=parent, child=child,
                                error=str(exc))
            return

    async def _recover(self, parents: Callable[[str], bool] | None) -> None:
        store = self._client.store
        after: str | None = None
        while True:
            page = await store.pending(after=after, limit=100)
            for waiting in page:
                parent = waiting.conversation_id
                if parents is not None and not parents(parent):
                    continue
                calls = {call.call_id for call in waiting.calls}
                since = min(call.position for call in waiting.calls)
                for event in await store.read_since(parent, since):
                    link = _link_of(event.body)
                    if link is not None and link.parent == parent and link.call_id in calls:
                        first = await store.read_range(link.child, 0, 0)
                        child_link = _link_of(first[0].body) if first else None
                        task = child_link.task if child_link is not None else ""
                        self._watch(parent, link.call_id, link.child, task, kick=True)
            if len(page) < 100:
                return
            after = page[-1].conversation_id


async def branch_tree(store: EventStore, conversation_id: str, depth: int = 8) -> Branch:
    """The conversation, its parent link and its sub-agents (recursively), from the logs
    alone (``Runtime.admin.branches``, ``torpor inspect``): wakes no agent."""
    events = await store.read_since(conversation_id, 0)
    if not events:
        raise UnknownConversation(conversation_id)
    own = _link_of(events[0].body)
    if own is not None and own.child != conversation_id:
        own = None
    progress = _Progress()
    for event in events:
        progress.see(event)
    children: list[Branch] = []
    for event in events:
        link = _link_of(event.body)
        if link is None or link.parent != conversation_id or link.child == conversation_id:
            continue
        if depth > 0:
            children.append(await branch_tree(store, link.child, depth - 1))
        else:
            children.append(Branch(conversation_id=link.child, parent=conversation_id,
                                   call_id=link.call_id, status="?"))
    return Branch(
        conversation_id=conversation_id,
        parent=own.parent if own is not None else None,
        call_id=own.call_id if own is not None else None,
        status=progress.status if own is not None else "",
        children=tuple(children),
    )
