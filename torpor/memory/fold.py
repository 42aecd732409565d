"""What a fold remembers: the summarizer's handoff, and with a model summarizer the span's
episodic item, its semantic items and the bundle rendered from all of them.

Derived from the log, never replacing it: the items go to their own tables
(:meth:`~torpor.store.protocol.EventStore.put_memory`), the bundle into the
checkpoint. Turns a hot-path reconciler said NONE for are left out of what the
summarizer reads (they stay in the log, and ``recall`` still finds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec

from torpor.compaction.summarizer import ModelSummarizer, SummaryOutcome
from torpor.memory.bundle import render_bundle
from torpor.store.memory import EpisodicItem, MemoryKind, SemanticItem

if TYPE_CHECKING:
    from torpor.compaction.fold import FoldPlan, Summarizer
    from torpor.events import Event
    from torpor.store.protocol import EventStore

__all__ = ["FoldMemory", "KIND_SALIENCE", "fold_memory", "items_of"]

KIND_SALIENCE: dict[MemoryKind, float] = {
    "constraint": 0.9,
    "decision": 0.8,
    "preference": 0.7,
    "fact": 0.6,
}
"""How much a semantic item of each kind is worth keeping in view (times its confidence)."""


class FoldMemory(msgspec.Struct, frozen=True, gc=False):
    summary: str  # the checkpoint's narrative ("" : carry the previous one)
    audit: SummaryOutcome | None  # a model summarizer's call, to record
    bundle: str  # the memory bundle for the checkpoint


def items_of(
    outcome: SummaryOutcome, position: int, events: Sequence[Event]
) -> tuple[EpisodicItem, list[SemanticItem]]:
    """The episodic item and semantic items of one fold's answer (ids from ``position``)."""
    turns = tuple(sorted({e.turn for e in events}))
    kinds = {d.kind for d in outcome.items}
    salience = min(1.0, 0.5 + 0.05 * len(outcome.items)
                   + (0.1 if kinds & {"decision", "constraint"} else 0.0))
    episode = EpisodicItem(
        position=position,
        start=events[0].position,
        end=max(e.position for e in events),
        turns=turns,
        summary=outcome.episode or outcome.text,
        salience=round(salience, 3),
        created_at=outcome.created_at,
    )
    facts = [
        SemanticItem(position, ordinal, d.key, d.kind, d.text, confidence=d.confidence,
                     salience=KIND_SALIENCE[d.kind], turns=turns, created_at=outcome.created_at)
        for ordinal, d in enumerate(outcome.items)
    ]
    return episode, facts


async def fold_memory(
    store: EventStore,
    summarizer: Summarizer,
    conversation_id: str,
    previous_summary: str,
    plan: FoldPlan,
    committed: int = -1,
) -> FoldMemory:
    """Summarize a planned fold and, for a model summarizer, store what it learned.

    A model summarizer's failure leaves a marker-only handoff for the span (no
    items, the standing bundle kept); any other Summarizer's exception
    propagates, as it always has. ``committed``: the previous checkpoint's position
    (-1: none). Called before the checkpoint is written, so items at positions
    after ``committed`` are an earlier attempt's whose checkpoint never landed
    (the store failed, the process died): they are left out of the bundle and
    replaced by this fold's, never shown twice beside them.
    """
    memory = await store.memory(conversation_id)
    skipped = set(memory.skipped_turns)
    events = [e for e in plan.events if e.turn not in skipped] if skipped else list(plan.events)
    if not isinstance(summarizer, ModelSummarizer):
        summary = await summarizer.summarize(previous_summary, events) if events else ""
        return FoldMemory(summary, None, "")
    episodes = [e for e in memory.episodes if e.position <= committed]
    facts = [f for f in memory.facts if f.position <= committed]
    leftovers = len(episodes) < len(memory.episodes) or len(facts) < len(memory.facts)
    outcome = await summarizer.run(previous_summary, events) if events else None
    if outcome is not None and outcome.error is None:
        episode, new_facts = items_of(outcome, plan.position, events)
        with anyio.CancelScope(shield=True):  # stored whole, or the fold did not happen
            await store.put_memory(conversation_id, episodes=[episode], facts=new_facts,
                                   replace_after=committed)
        episodes.append(episode)
        facts.extend(new_facts)
    elif leftovers:  # nothing to store, but the leftovers must not outlive this checkpoint
        with anyio.CancelScope(shield=True):
            await store.put_memory(conversation_id, replace_after=committed)
    bundle = ""
    if summarizer.memory_budget:
        bundle = render_bundle(episodes, facts, memory.ledger,
                               budget=summarizer.memory_budget, encoding=plan.policy.encoding)
    return FoldMemory(outcome.text if outcome is not None else "", outcome, bundle)
