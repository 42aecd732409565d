"""The runtime's memory methods: the derived memory of a conversation, the consolidation
sweep (on demand and, if configured, for idle conversations), the tool-interaction view.

A mixin of :class:`~torpor.runtime.host.Runtime`, so its one job stays out of
the host module. Nothing here wakes an agent: it all reads and writes the
store (the log is only ever read).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import msgspec

from torpor._logging import get_logger
from torpor.actors.state import AgentState
from torpor.errors import ConversationDeleted, InvalidInput
from torpor.memory.consolidate import Consolidation, KeyedConsolidator, consolidate
from torpor.memory.digest import Digest, write_digest
from torpor.memory.interactions import ToolInteraction, pair_tool_calls
from torpor.memory.ledger import surviving
from torpor.store.memory import MemoryRecord, SemanticItem
from torpor.text import check_id

if TYPE_CHECKING:
    from torpor.actors.agent import Profile
    from torpor.runtime.config import RuntimeConfig
    from torpor.runtime.erase import Erasure
    from torpor.runtime.registry import Registry
    from torpor.runtime.stats import Counters
    from torpor.store.protocol import EventStore

__all__ = ["IDLE_CONSOLIDATION_TIMEOUT", "MemoryAPI", "MemoryView"]

log = get_logger(__name__)

IDLE_CONSOLIDATION_TIMEOUT = 300.0
"""Seconds one idle-sweep consolidation may take when the conversation's
``AgentConfig.model_idle_timeout`` is None (otherwise that bounds it): a hung
consolidator must not hold up every later sweep."""


class MemoryView(msgspec.Struct, frozen=True, gc=False):
    """A conversation's derived memory as the agent would use it."""

    record: MemoryRecord  # everything stored: items, ledger, skipped turns
    standing: tuple[SemanticItem, ...]  # the facts the ledger leaves standing
    digest: Digest  # the bounded digest of the standing facts and the episodes


def _lines(max_lines: object) -> int:
    if type(max_lines) is not int or not 1 <= max_lines <= 10_000:
        raise InvalidInput("max_lines", f"must be an int from 1 to 10000, got {max_lines!r}")
    return max_lines


class MemoryAPI:
    """Memory methods of the Runtime (see the module doc)."""

    if TYPE_CHECKING:
        config: RuntimeConfig
        _registry: Registry
        _counters: Counters
        _erasure: Erasure

        @property
        def store(self) -> EventStore: ...

        def _check_open(self) -> None: ...

        def _check_owner(self, conversation_id: str) -> None: ...

        def _profile_for(self, conversation_id: str) -> Profile: ...

    async def memory(self, conversation_id: str, *, max_lines: int = 40) -> MemoryView:
        """Episodic and semantic items, the ledger, and the digest of what stands."""
        self._check_open()
        check_id(conversation_id)
        _lines(max_lines)
        record = await self.store.memory(conversation_id)
        standing = tuple(surviving(record.facts, record.ledger))
        digest = write_digest(standing, record.episodes, max_lines,
                              link=f"memory:{conversation_id}")
        return MemoryView(record, standing, digest)

    async def consolidate(self, conversation_id: str, *, max_lines: int = 40) -> Consolidation:
        """Run the consolidation sweep now: UPDATE/DELETE decisions for the conversation's
        semantic items go to the ledger (the log is never touched); returns them and the
        regenerated digest. The sweep is the conversation's ``AgentConfig.consolidator``
        (default :class:`~torpor.memory.KeyedConsolidator`). On a cluster node:
        ``NotOwner`` for a conversation another node serves (its writes are fenced).
        ``ConversationDeleted`` when the conversation is deleted meanwhile (the sweep is
        cancelled); ``MemoryChanged`` when a redaction dropped items it judged (nothing
        recorded: sweep again)."""
        self._check_open()
        check_id(conversation_id)
        _lines(max_lines)
        self._check_owner(conversation_id)
        consolidator = self._profile_for(conversation_id).config.consolidator
        if consolidator is None:
            consolidator = KeyedConsolidator()
        # A delete of the conversation cancels the sweep and waits for it (its ledger rows
        # must not land after the delete, nor in a conversation started afresh after it).
        with self._erasure.guard(conversation_id):
            return await consolidate(
                self.store, conversation_id, consolidator, max_lines=max_lines
            )
        raise ConversationDeleted(conversation_id)

    async def tool_interactions(self, conversation_id: str) -> list[ToolInteraction]:
        """Every tool call of the conversation paired with its result (or its fate:
        pending, aborted), in call order, derived from the log."""
        self._check_open()
        check_id(conversation_id)
        return pair_tool_calls(await self.store.read_since(conversation_id, 0))

    async def _consolidate_idle(self, interval: float) -> None:
        """Every ``interval`` seconds, sweep the idle conversations that folded since their
        last sweep (``RuntimeConfig.consolidate_interval``). One at a time, each bounded
        (:data:`IDLE_CONSOLIDATION_TIMEOUT`); a failure or a timeout is logged, counted
        (``consolidation_failures``) and retried at the next round."""
        swept: dict[str, int] = {}  # conversation -> compaction cycle at its last sweep
        while True:
            await anyio.sleep(interval)
            registry = self._registry
            due = [
                (agent.id, agent.cycle) for agent in list(registry)
                if agent.cycle > swept.get(agent.id, 0) and not agent.busy
                and agent.state in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED)
            ]
            for name in [n for n in swept if n not in registry]:
                del swept[name]  # evicted: its next fold (after revival) is swept again
            for name, cycle in due:
                started = time.perf_counter()
                try:
                    bound = self._profile_for(name).config.model_idle_timeout
                    with anyio.fail_after(bound or IDLE_CONSOLIDATION_TIMEOUT):
                        done = await self.consolidate(name)
                except Exception as exc:  # TimeoutError included: the sweep goes on
                    self._counters.consolidation_failures += 1
                    log.warning("consolidation_failed", conversation_id=name, error=repr(exc),
                                seconds=time.perf_counter() - started)
                    continue
                swept[name] = cycle
                log.debug("consolidated", conversation_id=name, decisions=len(done.decisions),
                          seconds=time.perf_counter() - started)
