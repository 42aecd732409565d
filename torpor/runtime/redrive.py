"""Re-drive: what a dead process left owing runs again without a new request.

A process that dies (``kill -9``, a lost lease) leaves conversations owing
work: the turn it was running (the log must say ``Aborted(interrupted)``) and
messages acknowledged as postponed behind it (they must be answered). Their
agents settle both as they revive, but nothing promises that a request ever
comes to revive them. So when a runtime starts (a single node: every
conversation) and when a node acquires shards (theirs), :class:`Redrive` pages
the store's open-work index (``EventStore.open_work``, see
:mod:`torpor.store.open_work`: never a log scan) and wakes each listed
conversation's agent through the runtime's ordinary path: the agent is made,
posted a request to hibernate once idle, and given its task. The actor alone
writes: reviving, it logs the ``Aborted`` owed and runs the postponed turns
(``torpor.actors.actor.revive``); with nothing left to run it takes the
request and hibernates, so re-driving many conversations keeps no working sets.
(Akka's remember-entities, Temporal's re-drive of a queue it takes over.)

Bounded: at most ``concurrency`` wakes at a time, each until its agent has
revived; over ``max_live_agents`` a conversation waits in the admission queue
like any other newcomer. A conversation whose agent is already here is left to
that agent; parked ones are never listed. Every run is a task owned here,
cancelled and awaited by :meth:`Redrive.stop`; a run logs its failures once,
with their count, not once per conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from torpor.actors.mailbox import HibernateRequest
from torpor.errors import StoreUnavailable

if TYPE_CHECKING:
    from torpor.runtime.admission import Admission
    from torpor.runtime.ports import Conversations, Starter, Stored
    from torpor.runtime.registry import Registry

__all__ = ["Redrive"]

PAGE = 100  # conversation ids per read of the index
_RETRY_FIRST = 0.5  # seconds before reading the index again while the store is down
_RETRY_MAX = 10.0


class _Outcome:
    """What one run did, reported once at its end."""

    __slots__ = ("error", "failed", "woken")

    def __init__(self) -> None:
        self.woken = 0
        self.failed = 0
        self.error: BaseException | None = None  # the first failure


class Redrive:
    __slots__ = (
        "_admission", "_concurrency", "_conversations", "_log", "_registry", "_runs",
        "_stopped", "_store", "_supervisor",
    )

    def __init__(
        self,
        *,
        store: Stored,
        conversations: Conversations,
        registry: Registry,
        admission: Admission,
        supervisor: Starter,
        log: Any,
        concurrency: int,
    ) -> None:
        self._store = store
        self._conversations = conversations
        self._registry = registry
        self._admission = admission
        self._supervisor = supervisor
        self._log = log
        self._concurrency = concurrency
        self._runs: set[asyncio.Task[None]] = set()
        self._stopped = False

    def run(
        self,
        *,
        shards: frozenset[int] | None = None,
        shard_count: int | None = None,
        serves: Callable[[str], bool] | None = None,
    ) -> None:
        """Re-drive, in the background, the open work of ``shards`` (of ``shard_count``;
        None: every conversation). ``serves``: asked again just before each wake (a shard
        may move on while the run goes through it)."""
        if self._stopped:
            return
        task = asyncio.get_running_loop().create_task(
            self._run(shards, shard_count, serves), name="torpor-redrive"
        )
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def stop(self) -> None:
        """Cancel every run and wait for each (the agents it woke go on: they are the
        supervisor's)."""
        self._stopped = True
        runs = list(self._runs)
        self._runs.clear()
        for task in runs:
            task.cancel()
        for task in runs:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(
        self,
        shards: frozenset[int] | None,
        shard_count: int | None,
        serves: Callable[[str], bool] | None,
    ) -> None:
        outcome = _Outcome()
        slots = asyncio.Semaphore(self._concurrency)
        try:
            async with asyncio.TaskGroup() as wakes:  # cancelled with the run: none outlives it
                async for conversation_id in self._listed(shards, shard_count):
                    if serves is not None and not serves(conversation_id):
                        continue
                    await slots.acquire()
                    wakes.create_task(self._wake_one(conversation_id, slots, outcome))
        except Exception as exc:  # reading the index failed for good: say so, once
            outcome.failed += 1
            outcome.error = outcome.error or exc
        if outcome.failed:
            self._log.warning("redrive_failed", failed=outcome.failed, woken=outcome.woken,
                              error=repr(outcome.error))
        elif outcome.woken:
            self._log.info("redrive_done", woken=outcome.woken,
                           shards=None if shards is None else len(shards))

    async def _listed(
        self, shards: frozenset[int] | None, shard_count: int | None
    ) -> AsyncIterator[str]:
        """The open conversations, page by page; while the store cannot be read, again
        after a backoff (warned once): the work is still owed when it comes back."""
        after: str | None = None
        delay = _RETRY_FIRST
        warned = False
        wanted = None if shards is None else sorted(shards)
        while True:
            try:
                page = await self._store.store.open_work(
                    shards=wanted, shard_count=shard_count, after=after, limit=PAGE
                )
            except StoreUnavailable as exc:
                if not warned:
                    self._log.warning("redrive_waits_for_store", error=str(exc))
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            for conversation_id in page:
                yield conversation_id
            if len(page) < PAGE:
                return
            after = page[-1]

    async def _wake_one(
        self, conversation_id: str, slots: asyncio.Semaphore, outcome: _Outcome
    ) -> None:
        try:
            if await self._wake(conversation_id):
                outcome.woken += 1
        except Exception as exc:
            outcome.failed += 1
            outcome.error = outcome.error or exc
        finally:
            slots.release()

    async def _wake(self, conversation_id: str) -> bool:
        """Start the conversation's agent, which runs what it owes; until it has revived.
        False: its agent is here already (it runs its own work)."""
        admission = self._admission
        if conversation_id in self._registry or conversation_id in admission.queue:
            return False
        if admission.must_wait(conversation_id):
            admission.waiting(conversation_id)  # revives once it has a slot, then runs
            return True
        agent = self._conversations.agent(conversation_id)
        revived: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        # Read after the revival (and the start of a postponed turn): it hibernates the
        # agent if nothing is left to run, and answers either way.
        agent.post(HibernateRequest(revived))
        self._registry.unqueue(agent)
        self._supervisor.ensure_running(agent)
        await revived
        if admission.queued():
            admission.admit()  # it may have hibernated: room for those waiting for a slot
        return True
