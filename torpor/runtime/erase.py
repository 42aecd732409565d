"""Deleting a conversation from a running runtime (``Runtime.delete``).

The store removes the rows (``EventStore.delete``: one audited transaction); here
the runtime makes sure nothing of it lives on or comes back:

1. The id is marked as being deleted, then the store is asked which conversations
   the delete will remove (:meth:`~torpor.store.protocol.EventStore.subtree`: the
   conversation and its sub-agent conversations) and those are marked too: a send,
   resolve, cancel, spawn or subscribe from then until the delete returns is refused
   with :class:`~torpor.errors.ConversationDeleted` (an ``UnknownConversation``), so
   nothing racing the delete starts one of them again.
2. Background work on them ends: work holding a :meth:`Erasure.guard` (an embedding
   pass's conversation, a consolidation sweep) is cancelled and waited for, and new
   work is refused; sub-agent watchers answering a call of one of them are cancelled
   (a watcher whose child goes and not its parent answers the parent's call with an
   error instead: :mod:`torpor.runtime.spawn`).
3. Their live agents are taken out of the runtime and stopped by their own actors
   (a ``StopRequest``, as when a shard moves away): a turn in flight ends, its
   last write lands before the delete, and whatever waits on it (a send whose
   message was not logged yet, a resolve) fails with ``ConversationDeleted``.
4. The store deletes; then every follower's stream ends with ``ConversationDeleted``
   (the final item a subscriber sees), and agents of sub-agent conversations linked
   after the store was asked are taken out too.

What is not serialized here (another process's writes, an actor abandoned past the
shutdown deadline) the store refuses: only an append creates a conversation, so a
late checkpoint, model-call row, artifact or memory write finds no row to attach to.

Once ``delete`` has returned the id is free: a later send starts a new, empty
conversation under it (the ``deletions`` audit says the earlier one was deleted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from torpor.errors import ConversationDeleted

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.admission import Admission
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.registry import Registry
    from torpor.runtime.spawn import Branches
    from torpor.runtime.stats import Counters
    from torpor.runtime.supervisor import Supervisor
    from torpor.store.protocol import EventStore

__all__ = ["Erasure", "Guard"]


class Guard:
    """Background work on one conversation (``with erasure.guard(name) as g:``): refused
    with ConversationDeleted while its delete runs; cancelled by a delete that starts
    meanwhile, which waits for the block to end (``g.cancelled`` says so after it)."""

    __slots__ = ("_erasure", "_scope", "ended", "name")

    def __init__(self, erasure: Erasure, name: str) -> None:
        self._erasure = erasure
        self.name = name
        self._scope = anyio.CancelScope()
        self.ended: asyncio.Future[None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._scope.cancelled_caught

    def cancel(self) -> None:
        self._scope.cancel()

    def __enter__(self) -> Guard:
        self._erasure.refuse(self.name)
        self.ended = asyncio.get_running_loop().create_future()
        self._erasure.work.setdefault(self.name, set()).add(self)
        self._scope.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            return bool(self._scope.__exit__(kind, exc, tb))
        finally:
            held = self._erasure.work.get(self.name)
            if held is not None:
                held.discard(self)
                if not held:
                    del self._erasure.work[self.name]
            assert self.ended is not None
            self.ended.set_result(None)


class Erasure:
    __slots__ = ("_admission", "_branches", "_config", "_counters", "_host", "_registry",
                 "_store", "_supervisor", "deleting", "work")

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        host: AgentHost,
        supervisor: Supervisor,
        admission: Admission,
        branches: Branches,
        store: Callable[[], EventStore],
    ) -> None:
        self._config = config
        self._registry = registry
        self._counters = counters
        self._host = host
        self._supervisor = supervisor
        self._admission = admission
        self._branches = branches
        self._store = store
        self.deleting: dict[str, asyncio.Future[None]] = {}  # id -> done when its delete is
        self.work: dict[str, set[Guard]] = {}  # id -> background work on it now

    def refuse(self, conversation_id: str) -> None:
        """ConversationDeleted while a delete of ``conversation_id`` runs."""
        if self.deleting and conversation_id in self.deleting:
            raise ConversationDeleted(conversation_id)

    def guard(self, conversation_id: str) -> Guard:
        """See :class:`Guard`."""
        return Guard(self, conversation_id)

    async def delete(
        self,
        conversation_id: str,
        *,
        by: str = "delete",
        unless: Callable[[], Awaitable[bool]] | None = None,
    ) -> bool:
        """See :meth:`torpor.Runtime.delete`. ``by``: the cause the audit records;
        ``unless``: asked once sends are refused, before anything is stopped; True keeps
        the conversation (retention: it became active meanwhile) and nothing is deleted."""
        running = self.deleting.get(conversation_id)
        if running is not None:  # deleted by the call already running; this one finds none
            await asyncio.shield(running)
            return False
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.deleting[conversation_id] = done
        marked = [conversation_id]
        try:
            if unless is not None and await unless():
                return False
            for name in await self._store().subtree(conversation_id):
                if name not in self.deleting:  # (one another delete has: left to it)
                    self.deleting[name] = done
                    marked.append(name)
            await self._quiesce(marked)
            await self._stop(marked)
            deletion = await self._store().delete(conversation_id, by=by)
            gone = [conversation_id] if deletion is None else list(deletion.conversations)
            late = [c for c in gone if c not in marked]
            for name in late:
                self.deleting.setdefault(name, done)
                marked.append(name)
            await self._quiesce(late)
            await self._stop(late)
            for name in gone:
                self._end_followers(name)
            return deletion is not None
        finally:
            for name in marked:
                if self.deleting.get(name) is done:
                    del self.deleting[name]
            done.set_result(None)

    async def _quiesce(self, names: list[str]) -> None:
        """End the background work on ``names`` (marked: no new work starts) and the
        sub-agent watchers answering a call of one of them."""
        if not names:
            return
        self._branches.drop_watchers(set(names))
        ended: list[asyncio.Future[None]] = []
        for name in names:
            for guard in list(self.work.get(name, ())):
                guard.cancel()
                if guard.ended is not None:
                    ended.append(guard.ended)
        if ended:
            await asyncio.wait(ended)

    async def _stop(self, names: list[str]) -> None:
        """Take the agents of ``names`` out and wait for their actors to stop."""
        tasks: list[asyncio.Task[None]] = []
        for name in names:
            agent = self._registry.get(name) or self._admission.queue.get(name)
            if agent is None:
                continue
            task = self._take_out(agent, ConversationDeleted(name))
            if task is not None:
                tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._config.shutdown_deadline)
            for task in pending:
                self._host.abandon(task, f"agent task {task.get_name()} of a deleted conversation")

    def _take_out(self, agent: Agent, error: ConversationDeleted) -> asyncio.Task[None] | None:
        if self._registry.get(agent.id) is agent:
            self._registry.remove(agent)
        self._admission.drop(agent.id)
        self._host.forget_bytes(agent)
        self._counters.evictions += 1
        return self._supervisor.retire(agent, error)

    def _end_followers(self, name: str) -> None:
        for follower in list(self._host.followers_by_id.get(name, ())):
            follower.close(ConversationDeleted(name))
