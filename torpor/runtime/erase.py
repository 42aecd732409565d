"""Deleting a conversation from a running runtime (``Runtime.delete``).

The store removes the rows (``EventStore.delete``: one audited transaction); here
the runtime makes sure nothing of it lives on or comes back:

1. The id (and its sub-agent conversations the runtime knows) is marked as being
   deleted: a send, resolve, cancel, spawn or subscribe from then until the delete
   returns is refused with :class:`~torpor.errors.ConversationDeleted` (an
   ``UnknownConversation``), so nothing racing the delete starts it again.
2. Its live agents are taken out of the runtime and stopped by their own actors
   (a ``StopRequest``, as when a shard moves away): a turn in flight ends, its
   last write lands before the delete, and whatever waits on it (a send whose
   message was not logged yet, a resolve) fails with ``ConversationDeleted``.
3. The store deletes; then every follower's stream ends with ``ConversationDeleted``
   (the final item a subscriber sees), and agents of sub-agent conversations found
   only by the store are taken out too.

Once ``delete`` has returned the id is free: a later send starts a new, empty
conversation under it (the ``deletions`` audit says the earlier one was deleted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from torpor.errors import ConversationDeleted

if TYPE_CHECKING:
    from torpor.actors.agent import Agent
    from torpor.runtime.admission import Admission
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters
    from torpor.runtime.supervisor import Supervisor
    from torpor.store.protocol import EventStore

__all__ = ["Erasure"]


class Erasure:
    __slots__ = ("_admission", "_config", "_counters", "_host", "_registry", "_store",
                 "_supervisor", "deleting")

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        registry: Registry,
        counters: Counters,
        host: AgentHost,
        supervisor: Supervisor,
        admission: Admission,
        store: Callable[[], EventStore],
    ) -> None:
        self._config = config
        self._registry = registry
        self._counters = counters
        self._host = host
        self._supervisor = supervisor
        self._admission = admission
        self._store = store
        self.deleting: dict[str, asyncio.Future[None]] = {}  # id -> done when its delete is

    def refuse(self, conversation_id: str) -> None:
        """ConversationDeleted while a delete of ``conversation_id`` runs."""
        if self.deleting and conversation_id in self.deleting:
            raise ConversationDeleted(conversation_id)

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
        marked = [c for c in self._family(conversation_id) if c not in self.deleting]
        for name in marked:
            self.deleting[name] = done
        try:
            if unless is not None and await unless():
                return False
            await self._stop(marked)
            deletion = await self._store().delete(conversation_id, by=by)
            gone = [conversation_id] if deletion is None else list(deletion.conversations)
            late = [c for c in gone if c not in marked]
            for name in late:
                self.deleting.setdefault(name, done)
                marked.append(name)
            await self._stop(late)
            for name in gone:
                self._end_followers(name)
            return deletion is not None
        finally:
            for name in marked:
                if self.deleting.get(name) is done:
                    del self.deleting[name]
            done.set_result(None)

    def _family(self, conversation_id: str) -> list[str]:
        """The conversation and the sub-agents the runtime holds under its default child
        names (``"<id>/…"``, ``"{<id>}/…"``); others are found by the store's delete."""
        prefixes = (f"{conversation_id}/", f"{{{conversation_id}}}/")
        held = [a.id for a in self._registry.held() if a.id.startswith(prefixes)]
        queued = [c for c in self._admission.queue if c.startswith(prefixes)]
        return [conversation_id, *held, *queued]

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
