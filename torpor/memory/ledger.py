"""Which semantic items survive the ledger: a pure function of the items and the decisions.

Per key, the newest item is the fact, unless the key's latest ledger decision is a
tombstone that reaches it (``delete`` of an item at or after it). An ``update``
names the key's current item and the ones it superseded; a fact written after
the decision (a later fold) is newer still, and wins. Nothing here is ever
removed from the log: a superseded or tombstoned fact is only left out of what
the agent is shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torpor.store.memory import LedgerEntry, SemanticItem

__all__ = ["item_order", "latest_decisions", "superseded_ids", "surviving"]


def item_order(item_id: str) -> tuple[int, int]:
    """The (position, ordinal) an item id names; unreadable ids sort first."""
    position, _, ordinal = item_id.partition(".")
    try:
        return int(position), int(ordinal or 0)
    except ValueError:
        return (-1, -1)


def latest_decisions(ledger: Iterable[LedgerEntry]) -> dict[str, LedgerEntry]:
    """The latest decision of every key (ledger rows in ``seq`` order)."""
    latest: dict[str, LedgerEntry] = {}
    for entry in ledger:
        latest[entry.key] = entry
    return latest


def surviving(
    facts: Sequence[SemanticItem], ledger: Iterable[LedgerEntry]
) -> list[SemanticItem]:
    """One item per key still standing, oldest first."""
    decisions = latest_decisions(ledger)
    newest: dict[str, SemanticItem] = {}
    for item in facts:
        held = newest.get(item.key)
        if held is None or item.order > held.order:
            newest[item.key] = item
    out = []
    for key, item in newest.items():
        decision = decisions.get(key)
        if (
            decision is not None
            and decision.action == "delete"
            and item.order <= item_order(decision.item)
        ):
            continue  # tombstoned, and nothing newer came since
        out.append(item)
    out.sort(key=lambda item: item.order)
    return out


def superseded_ids(facts: Sequence[SemanticItem], ledger: Iterable[LedgerEntry]) -> set[str]:
    """Ids of the items that no longer stand (superseded by a newer one, or tombstoned)."""
    standing = {item.id for item in surviving(facts, ledger)}
    return {item.id for item in facts if item.id not in standing}
