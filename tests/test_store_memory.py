"""Derived memory in the store, on every backend: items, the ledger, turn decisions."""

from __future__ import annotations

import pytest
from store_backends import AnyStore, Backend

from torpor import InvalidInput, UnknownConversation
from torpor.events import UserMessage
from torpor.store.memory import EpisodicItem, LedgerEntry, SemanticItem
from torpor.store.protocol import Checkpoint


def fact(position: int, ordinal: int, key: str, text: str) -> SemanticItem:
    return SemanticItem(position, ordinal, key, "fact", text, confidence=0.8, turns=(1,))


async def test_items_round_trip_and_a_retried_fold_writes_nothing_twice(store: AnyStore) -> None:
    await store.append("c", [UserMessage("hello")] * 3, turn=1)
    episode = EpisodicItem(2, 0, 1, (1,), "the user said hello", salience=0.7)
    facts = [fact(2, 0, "greeting", "the user says hello"), fact(2, 1, "tone", "friendly")]
    await store.put_memory("c", episodes=[episode], facts=facts)
    changed = EpisodicItem(2, 0, 1, (1,), "a different summary")
    await store.put_memory("c", episodes=[changed], facts=facts[:1])  # the same ids again
    memory = await store.memory("c")
    assert [e.summary for e in memory.episodes] == ["the user said hello"]
    assert memory.episodes[0].created_at > 0 and memory.episodes[0].id == "episode:2"
    assert [(f.id, f.key, f.text) for f in memory.facts] == [
        ("2.0", "greeting", "the user says hello"), ("2.1", "tone", "friendly")]
    assert memory.ledger == () and memory.skipped_turns == ()
    assert (await store.memory("nobody")).episodes == ()
    assert len(await store.read_since("c", 0)) == 3  # the log is untouched


async def test_the_ledger_keeps_the_latest_decision_per_key_and_a_bounded_tail(
    store: AnyStore,
) -> None:
    await store.append("c", [UserMessage("x")])
    for i in range(6):
        await store.put_ledger("c", [LedgerEntry("a", "update", f"{i}.0", reason=f"r{i}")],
                               tail=2)
    ledger = (await store.memory("c")).ledger
    assert [(e.key, e.item, e.reason) for e in ledger] == [("a", "4.0", "r4"), ("a", "5.0", "r5")]
    await store.put_ledger("c", [LedgerEntry("b", "delete", "0.1")], tail=2)
    await store.put_ledger("c", [LedgerEntry("c", "delete", "1.1")], tail=1)
    ledger = (await store.memory("c")).ledger
    # The latest of every key stays, however short the tail.
    assert [(e.key, e.item) for e in ledger] == [("a", "5.0"), ("b", "0.1"), ("c", "1.1")]
    assert [e.seq for e in ledger] == sorted(e.seq for e in ledger) and ledger[0].seq > 0


async def test_turn_decisions_record_what_a_reconciler_skipped(store: AnyStore) -> None:
    await store.append("c", [UserMessage("x")])
    await store.put_turn_decision("c", 3, "none")
    await store.put_turn_decision("c", 5, "none")
    await store.put_turn_decision("c", 5, "add")  # the latest verdict stands
    assert (await store.memory("c")).skipped_turns == (3,)


async def test_bad_memory_is_refused_before_anything_is_written(store: AnyStore) -> None:
    await store.append("c", [UserMessage("x")])
    with pytest.raises(InvalidInput, match=r"facts\[0\]\.confidence"):
        await store.put_memory("c", facts=[SemanticItem(1, 0, "k", "fact", "t", confidence=2.0)])
    with pytest.raises(InvalidInput, match="kind"):
        await store.put_memory("c", facts=[SemanticItem(1, 0, "k", "opinion", "t")])  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="key"):
        await store.put_memory("c", facts=[fact(1, 0, "", "t")])
    with pytest.raises(UnknownConversation, match="unknown"):  # a memory write creates none
        await store.put_memory("unknown", facts=[fact(1, 0, "k", "t")])
    with pytest.raises(InvalidInput, match="decision"):
        await store.put_turn_decision("c", 1, "maybe")
    with pytest.raises(InvalidInput, match="action"):
        await store.put_ledger("c", [LedgerEntry("k", "merge", "1.0")])  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="episodes"):
        await store.put_memory("c", episodes=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="facts"):
        await store.put_memory("c", facts=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="entries"):
        await store.put_ledger("c", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"episodes\[0\]\.start"):
        await store.put_memory("c", episodes=[EpisodicItem(9, 5, 2, (1,), "backwards")])
    assert (await store.memory("c")).facts == ()


async def test_memory_survives_reopening(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("x")])
        await store.put_memory("c", facts=[fact(1, 0, "k", "kept")])
    async with backend.open() as store:
        assert [f.text for f in (await store.memory("c")).facts] == ["kept"]


async def test_replace_after_drops_only_unbacked_items_after_it(store: AnyStore) -> None:
    """What a fold that never landed left (no checkpoint at its position) is replaced; a
    checkpointed fold's items never are, whoever writes (a stale writer on a cluster)."""
    await store.append("c", [UserMessage("x")] * 9)
    await store.put_memory("c", episodes=[EpisodicItem(2, 0, 1, (1,), "kept")],
                           facts=[SemanticItem(2, 0, "k", "fact", "kept")])
    await store.put_memory("c", episodes=[EpisodicItem(5, 2, 4, (2,), "orphan")],
                           facts=[SemanticItem(5, i, f"o{i}", "fact", "orphan") for i in range(3)])
    await store.put_memory("c", episodes=[EpisodicItem(5, 2, 4, (2,), "retried")],
                           facts=[SemanticItem(5, 0, "r", "fact", "retried")], replace_after=2)
    memory = await store.memory("c")
    assert [(e.position, e.summary) for e in memory.episodes] == [(2, "kept"), (5, "retried")]
    assert [(f.id, f.text) for f in memory.facts] == [("2.0", "kept"), ("5.0", "retried")]
    # Position 5 is checkpointed now: a write replacing after 2 leaves it, drops 8.
    await store.put_checkpoint(Checkpoint("c", 5, 0, 1))
    await store.put_memory("c", episodes=[EpisodicItem(8, 5, 7, (3,), "in flight")])
    await store.put_memory("c", facts=[SemanticItem(9, 0, "s", "fact", "stale")],
                           replace_after=2)
    memory = await store.memory("c")
    assert [(e.position, e.summary) for e in memory.episodes] == [(2, "kept"), (5, "retried")]
    assert [f.id for f in memory.facts] == ["2.0", "5.0", "9.0"]
    with pytest.raises(InvalidInput, match="replace_after"):
        await store.put_memory("c", replace_after=-2)
