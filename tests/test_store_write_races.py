"""Writes racing a delete or a redaction, at the store (torpor.runtime.erase's backstop).

Only an append creates a conversation. A write that hangs something on one (a
checkpoint, an artifact, a model call's audit row, memory items, ledger rows, a
turn decision, vectors) arriving after its delete is refused (UnknownConversation;
vectors: dropped) and leaves no row behind, so a background task that lost the race
cannot bring back an empty, listed conversation with its rows. A consolidation
sweep's ledger rows naming items a redaction dropped are refused whole
(MemoryChanged), on every backend.
"""

from __future__ import annotations

import pytest
from store_backends import AnyStore, Backend

from torpor.errors import ConflictError, MemoryChanged, UnknownConversation
from torpor.events import AssistantMessage, Spawned, UserMessage
from torpor.store.memory import LedgerEntry, SemanticItem
from torpor.store.protocol import Checkpoint, ModelCall
from torpor.store.vectors import vector_index


async def _gone(store: AnyStore, name: str) -> None:
    """Nothing of ``name`` in any read: no row, no event, no listing entry."""
    assert await store.conversation(name) is None
    assert await store.head(name) is None
    assert (await store.list_conversations()).items == ()
    assert await store.model_calls(name) == []
    assert await store.checkpoints(name) == []
    record = await store.memory(name)
    assert (record.episodes, record.facts, record.ledger) == ((), (), ())


async def test_writes_after_a_delete_create_nothing(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("hello")])
        await store.append("c", [AssistantMessage("hi")], turn=1)
        assert await store.delete("c") is not None

        with pytest.raises(UnknownConversation):
            await store.put_checkpoint(Checkpoint("c", 0, 1, 1, summary="late fold"))
        with pytest.raises(UnknownConversation):
            await store.put_artifact("c", b"late artifact")
        with pytest.raises(UnknownConversation):
            await store.record_model_call(ModelCall("c", 1, 0, 2, b"r", "h", {}, 1, 0.1))
        with pytest.raises(UnknownConversation):
            await store.put_memory("c", facts=[SemanticItem(1, 0, "k", "fact", "late")])
        with pytest.raises(UnknownConversation):
            await store.put_ledger("c", [LedgerEntry("k", "delete", "1.0")])
        with pytest.raises(UnknownConversation):
            await store.put_turn_decision("c", 1, "none")
        await vector_index(store).put("c", "space", [(0, [1.0, 0.0])], 1)  # dropped
        # A turn's answer whose head moved under it (the delete), with its model call's
        # audit row: refused, and the audit row is not written either.
        with pytest.raises(ConflictError):
            await store._append_audited(  # the runtime's path for an answer
                "c", [AssistantMessage("late answer")], 2, 1,
                ModelCall("c", 2, 0, 2, b"r", "h", {}, 1, 0.1),
            )
        await _gone(store, "c")
        assert await vector_index(store).progress("c", "space") == -1

        # An append still starts the conversation afresh, and the rest then attaches.
        assert await store.append("c", [UserMessage("again")]) == [0]
        await store.put_checkpoint(Checkpoint("c", 1, 1, 1, summary="fresh"))
        await store.record_model_call(ModelCall("c", 1, 0, 2, b"r", "h", {}, 1, 0.1))
        assert [c.summary for c in await store.checkpoints("c")] == ["fresh"]
        assert len(await store.model_calls("c")) == 1


async def test_writes_to_an_unknown_conversation_create_nothing(store: AnyStore) -> None:
    with pytest.raises(UnknownConversation):
        await store.put_checkpoint(Checkpoint("new", 0, 1, 1))
    with pytest.raises(UnknownConversation):
        await store.record_model_call(ModelCall("new", 1, 0, 2, b"r", "h", {}, 1, 0.1))
    with pytest.raises(UnknownConversation):
        await store.put_artifact("new", b"data")
    await _gone(store, "new")


async def _with_two_folds(store: AnyStore, name: str) -> None:
    """A fold at 2 covering the secret at 0 (its fact 2.0), one at 4 after it (fact 4.0)."""
    await store.append(name, [UserMessage("the password is hunter2")])  # 0
    await store.append(name, [AssistantMessage("noted")], turn=1)  # 1
    await store.append(name, [UserMessage("my city is Lyon")], turn=2)  # 2
    await store.append(name, [AssistantMessage("ok")], turn=2)  # 3
    await store.append(name, [UserMessage("more")], turn=3)  # 4
    await store.put_checkpoint(Checkpoint(name, 2, 1, 1, summary="password hunter2"))
    await store.put_memory(name, facts=[SemanticItem(2, 0, "password", "fact", "hunter2"),
                                        SemanticItem(2, 1, "city", "fact", "Paris")])


async def test_a_sweep_racing_a_redaction_records_nothing_naming_dropped_items(
    store: AnyStore,
) -> None:
    await _with_two_folds(store, "c")
    swept = await store.memory("c")  # the sweep reads the memory ...
    assert {f.id for f in swept.facts} == {"2.0", "2.1"}
    assert await store.redact("c", 0, reason="secret") is True  # ... a redaction drops it ...
    decision = LedgerEntry("password", "update", "2.0", ("2.1",), reason="hunter2 is current")
    with pytest.raises(MemoryChanged) as caught:  # ... and its decisions are refused whole
        await store.put_ledger("c", [decision], stored_only=True)
    assert set(caught.value.items) == {"2.0", "2.1"}
    assert (await store.memory("c")).ledger == ()

    # Decisions naming items that stand are recorded; so are unchecked ones (the default).
    await store.put_checkpoint(Checkpoint("c", 4, 2, 2, summary="city"))
    await store.put_memory("c", facts=[SemanticItem(4, 0, "city", "fact", "Lyon")])
    await store.put_ledger("c", [LedgerEntry("city", "delete", "4.0")], stored_only=True)
    with pytest.raises(MemoryChanged):
        await store.put_ledger("c", [LedgerEntry("city", "delete", "not-an-id")],
                               stored_only=True)
    await store.put_ledger("c", [LedgerEntry("city", "delete", "9.9")])
    assert [e.item for e in (await store.memory("c")).ledger] == ["4.0", "9.9"]


async def test_subtree_names_what_a_delete_removes(store: AnyStore) -> None:
    """The runtime asks it before a delete, to stop exactly those agents."""
    await store.append("p", [UserMessage("go")])
    await store.append("p/x", [Spawned("p", "c1", "p/x", "task")])  # the child's link first
    await store.append("p", [Spawned("p", "c1", "p/x")], turn=1)
    await store.append("p/x/y", [Spawned("p/x", "c2", "p/x/y", "deeper")])
    await store.append("p/x", [Spawned("p/x", "c2", "p/x/y")], turn=1)
    await store.append("p/other", [UserMessage("not a sub-agent")])
    assert await store.subtree("p") == ["p", "p/x", "p/x/y"]
    assert await store.subtree("p/x") == ["p/x", "p/x/y"]
    assert await store.subtree("nothing") == []
    deletion = await store.delete("p")
    assert deletion is not None and list(deletion.conversations) == ["p", "p/x", "p/x/y"]
    assert await store.subtree("p") == [] and await store.subtree("p/other") == ["p/other"]
