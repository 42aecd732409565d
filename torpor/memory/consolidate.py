"""The consolidation sweep (design source 001, sections 8.3 and A.3): UPDATE and DELETE.

Off the hot path, a :class:`Consolidator` compares the semantic items of a
conversation with the ledger and returns decisions: ``update`` (a newer fact
supersedes older ones under its key) and ``delete`` (the key's fact is stale:
a tombstone). They become ledger rows; the log is never mutated, and the items
themselves stay stored. The digest is then regenerated from what stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from torpor.errors import ConfigError, InvalidInput
from torpor.memory.digest import Digest, write_digest
from torpor.memory.ledger import item_order, latest_decisions, surviving
from torpor.store.memory import (
    LedgerEntry,
    MemoryRecord,
    SemanticItem,
    check_items,
    check_ledger_entry,
)

if TYPE_CHECKING:
    from torpor.store.protocol import EventStore

__all__ = ["Consolidation", "Consolidator", "KeyedConsolidator", "consolidate"]


@runtime_checkable
class Consolidator(Protocol):
    """The sweep's judge: may be slow, may call a model; returns ledger decisions."""

    async def sweep(
        self, conversation_id: str, memory: MemoryRecord
    ) -> Sequence[LedgerEntry]: ...


class KeyedConsolidator:
    """The deterministic default.

    Per key, the newest item supersedes every older one (``update``: same thing,
    newer statement); a key whose newest item is less confident than
    ``min_confidence`` is tombstoned (``delete``). A key already decided up to
    its newest item is left alone, so sweeping twice adds nothing.
    """

    def __init__(self, *, min_confidence: float = 0.0) -> None:
        if (isinstance(min_confidence, bool) or not isinstance(min_confidence, int | float)
                or not 0.0 <= min_confidence <= 1.0):
            raise ConfigError("min_confidence", f"must be 0..1, got {min_confidence!r}")
        self.min_confidence = float(min_confidence)

    async def sweep(self, conversation_id: str, memory: MemoryRecord) -> list[LedgerEntry]:
        decided = latest_decisions(memory.ledger)
        by_key: dict[str, list[SemanticItem]] = {}
        for item in memory.facts:
            by_key.setdefault(item.key, []).append(item)
        out: list[LedgerEntry] = []
        for key, items in by_key.items():
            items.sort(key=lambda i: i.order)
            newest = items[-1]
            last = decided.get(key)
            if last is not None and item_order(last.item) >= newest.order:
                continue
            if newest.confidence < self.min_confidence:
                out.append(LedgerEntry(key, "delete", newest.id,
                                       reason=f"confidence {newest.confidence:g} below "
                                              f"{self.min_confidence:g}"))
            elif len(items) > 1:
                out.append(LedgerEntry(key, "update", newest.id,
                                       superseded=tuple(i.id for i in items[:-1]),
                                       reason="a newer fact under the same key"))
        return out


class Consolidation(msgspec.Struct, frozen=True, gc=False):
    """One sweep: the decisions it recorded, and the digest of what stands after it."""

    conversation_id: str
    decisions: tuple[LedgerEntry, ...]
    digest: Digest


def _checked(memory: MemoryRecord, answer: object) -> tuple[LedgerEntry, ...]:
    """A sweep's decisions, each naming items of its own key that the sweep was shown;
    InvalidInput (nothing recorded) otherwise: a decision about an item it never saw, or
    under another key, would hide or revive facts it did not judge."""
    decisions = check_items(answer, "decisions", check_ledger_entry)
    keys = {item.id: item.key for item in memory.facts}
    for index, entry in enumerate(decisions):
        what = f"decisions[{index}]"
        for name, item in [("item", entry.item), *(("superseded", s) for s in entry.superseded)]:
            if keys.get(item) != entry.key:
                raise InvalidInput(f"{what}.{name}", f"{item!r} is not an item under key "
                                                     f"{entry.key!r} in the swept memory")
    return tuple(decisions)


async def consolidate(
    store: EventStore,
    conversation_id: str,
    consolidator: Consolidator,
    *,
    max_lines: int = 40,
) -> Consolidation:
    """Run one sweep over a conversation's memory and record its decisions in the ledger.

    Decisions that do not name items of their key in the swept memory are refused whole
    (InvalidInput), before anything is recorded; so are decisions naming items that a
    redaction dropped while the sweep ran (MemoryChanged: the store checks in the
    ledger write's transaction), and the sweep's conversation deleted meanwhile
    (UnknownConversation).
    """
    memory = await store.memory(conversation_id)
    decisions = _checked(memory, await consolidator.sweep(conversation_id, memory))
    if decisions:
        await store.put_ledger(conversation_id, decisions, stored_only=True)
        decisions = await _as_stored(store, conversation_id, memory.ledger, decisions)
    ledger = (*memory.ledger, *decisions)
    digest = write_digest(surviving(memory.facts, ledger), memory.episodes, max_lines,
                          link=f"memory:{conversation_id}")
    return Consolidation(conversation_id, decisions, digest)


async def _as_stored(
    store: EventStore,
    conversation_id: str,
    before: tuple[LedgerEntry, ...],
    decisions: tuple[LedgerEntry, ...],
) -> tuple[LedgerEntry, ...]:
    """The decisions as the store holds them (their ``seq`` and ``created_at`` are set
    when stored), matched among the entries newer than ``before``; a decision not found
    (a concurrent sweep's pruning) is returned as it was."""
    last = max((e.seq for e in before), default=0)
    fresh = [e for e in (await store.memory(conversation_id)).ledger if e.seq > last]
    stored: list[LedgerEntry] = []
    for decision in decisions:
        unstamped = msgspec.structs.replace(decision, created_at=0, seq=0)
        match = next((e for e in fresh if
                      msgspec.structs.replace(e, created_at=0, seq=0) == unstamped), None)
        if match is not None:
            fresh.remove(match)
        stored.append(match or decision)
    return tuple(stored)
