"""Memory beyond the working set (design sources 001 §8 and 002), derived from the log.

Episodic and semantic items written at folds (:mod:`.fold`), the memory bundle
in the compaction snapshot (:mod:`.bundle`), the hot-path reconciler
(:mod:`.reconcile`), the consolidation sweep and its ledger (:mod:`.consolidate`,
:mod:`.ledger`), the bounded digest (:mod:`.digest`) and the paired
tool-call/result view (:mod:`.interactions`). The log is never mutated.
"""

from torpor.memory.bundle import render_bundle
from torpor.memory.consolidate import Consolidation, Consolidator, KeyedConsolidator, consolidate
from torpor.memory.digest import Digest, write_digest
from torpor.memory.interactions import ToolInteraction, pair_tool_calls
from torpor.memory.ledger import surviving
from torpor.memory.reconcile import AddEverything, HotDecision, Reconciler
from torpor.store.memory import EpisodicItem, LedgerEntry, MemoryRecord, SemanticItem

__all__ = [
    "AddEverything",
    "Consolidation",
    "Consolidator",
    "Digest",
    "EpisodicItem",
    "HotDecision",
    "KeyedConsolidator",
    "LedgerEntry",
    "MemoryRecord",
    "Reconciler",
    "SemanticItem",
    "ToolInteraction",
    "consolidate",
    "pair_tool_calls",
    "render_bundle",
    "surviving",
    "write_digest",
]
