"""Retention: conversations with no activity for ``RuntimeConfig.retention`` seconds are deleted.

A background task the runtime owns (started on entry, cancelled on exit) runs a
pass every :func:`interval` seconds; ``Runtime.expire()`` runs one now (tests,
``torpor purge``). A pass reads the oldest idle conversations from the store's
activity index (``EventStore.idle_conversations``: never a log scan), at most
:data:`RETENTION_BATCH`, and deletes each one as ``Runtime.delete`` does (agents
stopped, followers ended), recorded in ``deletions`` with ``by="retention"``. A
pass that filled its batch is followed at once by the next, so a backlog drains
in bounded steps. Each pass logs one ``retention_pass`` record (counts, never
ids) and adds to the ``retention_deletions`` counter.

What a pass keeps although it is old:

* a conversation whose agent is busy (mid-turn, input waiting, turns postponed
  behind a suspension); the next pass looks again;
* one that became active between the listing and its delete (checked again once
  new sends are refused: a send in that window is refused with
  ``ConversationDeleted`` and may be retried, the conversation is kept);
* on a cluster node, the conversations of shards it does not serve: their owner
  deletes them (fenced like any write: a shard that moves during the pass refuses
  the delete with ``FencedError``, and the conversation is counted as kept).

A pass that fails (the store unavailable) is logged (``retention_pass_failed``) and
the sweep goes on at the next interval.

A conversation suspended on an approval is deleted once its last activity is
older than the retention, like any other: waiting for an answer is not activity.
A sub-agent conversation goes by its own last activity (its parent's log keeps
the answer it gave), and with its parent when the parent goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from torpor.errors import FencedError, NotOwner
from torpor.store.prepare import now_ms

if TYPE_CHECKING:
    from torpor.runtime.erase import Erasure
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters
    from torpor.store.protocol import EventStore

__all__ = ["RETENTION_BATCH", "RETENTION_INTERVAL", "Retention", "interval"]

RETENTION_BATCH = 100
"""Conversations one pass deletes at most."""

RETENTION_INTERVAL = 60.0
"""Seconds between passes at most (a retention shorter than four times this: a quarter
of it, down to a second)."""

Shards = Callable[[], "tuple[Sequence[int], int] | None"]


def interval(retention: float) -> float:
    return min(RETENTION_INTERVAL, max(1.0, retention / 4))


class Retention:
    __slots__ = ("_check", "_counters", "_erasure", "_log", "_registry", "_shards", "_store")

    def __init__(
        self,
        *,
        erasure: Erasure,
        registry: Registry,
        counters: Counters,
        store: Callable[[], EventStore],
        shards: Shards,
        check: Callable[[str], None],
        log: Any,
    ) -> None:
        self._erasure = erasure
        self._registry = registry
        self._counters = counters
        self._store = store
        self._shards = shards  # None: every conversation; else (served shards, shard count)
        self._check = check  # NotOwner for a conversation this node does not serve
        self._log = log

    async def run(self, retention: float) -> None:
        """Passes forever (the runtime cancels this task on exit)."""
        every = interval(retention)
        while True:
            await anyio.sleep(every)
            try:
                while await self.expire(retention) == RETENTION_BATCH:
                    pass  # a full batch: a backlog, drained pass by pass
            except Exception as exc:  # a store outage above all: the next interval retries
                self._log.warning("retention_pass_failed", error=repr(exc))

    async def expire(self, older_than: float, *, now: int | None = None) -> int:
        """One pass: delete up to :data:`RETENTION_BATCH` conversations with no activity
        for ``older_than`` seconds before ``now`` (epoch ms; default the wall clock).
        Returns how many were deleted."""
        started = time.perf_counter()
        before = max(0, (now_ms() if now is None else now) - int(older_than * 1000))
        place = self._shards()
        if place is None:
            found = await self._store().idle_conversations(before=before, limit=RETENTION_BATCH)
        else:
            shards, count = place
            found = await self._store().idle_conversations(
                before=before, limit=RETENTION_BATCH, shards=shards, shard_count=count)
        deleted = kept = 0
        for name in found:
            try:
                self._check(name)
            except NotOwner:  # its shard moved meanwhile: its new owner's pass
                kept += 1
                continue
            try:
                gone = await self._erasure.delete(name, by="retention",
                                                  unless=self._active(name, before))
            except FencedError:  # the shard moved after the check: the new owner's to delete
                gone = False
            if gone:
                deleted += 1
            else:
                kept += 1
        self._counters.retention_deletions += deleted
        self._log.info("retention_pass", idle=len(found), deleted=deleted, kept=kept,
                       ms=round((time.perf_counter() - started) * 1000, 3))
        return deleted

    def _active(self, name: str, before: int) -> Callable[[], Any]:
        async def active() -> bool:
            agent = self._registry.agents.get(name)
            if agent is not None and agent.busy:
                return True
            info = await self._store().conversation(name)
            return info is None or info.updated_at >= before

        return active
