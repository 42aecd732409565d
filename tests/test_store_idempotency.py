"""Issue 8, item 10: an idempotency key reused for a different message is refused.

The key stands for the user's message (the first body of the keyed append): the
same key with the same message returns the first positions and writes nothing;
with another message it raises IdempotencyConflict and writes nothing, on both
backends, across batches, within one batch, and for keys stored before
fingerprints existed (schema version 1).
"""

from __future__ import annotations

import asyncio

import pytest
from store_backends import Backend

from torpor import IdempotencyConflict
from torpor.events import ToolResult, UserMessage


async def test_same_key_other_text_is_a_conflict_and_writes_nothing(backend: Backend) -> None:
    async with backend.open() as store:
        assert await store.append("c", [UserMessage("pay invoice 42")], key="req-1") == [0]
        with pytest.raises(IdempotencyConflict) as caught:
            await store.append("c", [UserMessage("pay invoice 43")], key="req-1")
        assert (caught.value.conversation_id, caught.value.key) == ("c", "req-1")
        assert isinstance(caught.value, ValueError)
        with pytest.raises(IdempotencyConflict):
            await store.append_events("c", [UserMessage("pay invoice 43")], key="req-1")
        assert await store.head("c") == 0
        # the same text is still the same request
        assert await store.append("c", [UserMessage("pay invoice 42")], key="req-1") == [0]
        (event,) = await store.append_events("c", [UserMessage("pay invoice 42")], key="req-1")
        assert event.position == 0 and event.body == UserMessage("pay invoice 42")
    async with backend.open() as reopened:  # the fingerprint is in the database
        with pytest.raises(IdempotencyConflict):
            await reopened.append("c", [UserMessage("pay invoice 43")], key="req-1")
        assert await reopened.append("c", [UserMessage("pay invoice 42")], key="req-1") == [0]
        assert await reopened.head("c") == 0


async def test_within_one_batch(backend: Backend) -> None:
    async with backend.open() as store:
        outcomes = await asyncio.gather(
            store.append("c", [UserMessage("first")], key="k"),
            store.append("c", [UserMessage("second")], key="k"),
            store.append("c", [UserMessage("first")], key="k"),
            return_exceptions=True,
        )
        assert outcomes[0] == [0] and outcomes[2] == [0]
        assert isinstance(outcomes[1], IdempotencyConflict)
        assert await store.head("c") == 0


async def test_a_clipped_first_body_still_matches_itself(backend: Backend) -> None:
    big = ToolResult("call-1", "cat", "line\n" * 10_000)  # clipped into an artifact
    async with backend.open() as store:
        (event,) = await store.append_events("c", [big], key="k")
        assert isinstance(event.body, ToolResult) and event.body.artifact is not None
        assert await store.append("c", [big], key="k") == [0]
        with pytest.raises(IdempotencyConflict):
            await store.append("c", [ToolResult("call-1", "cat", "other")], key="k")


async def test_keys_stored_before_fingerprints_compare_the_first_body(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("old message")], key="old")
    await backend.sql("UPDATE idempotency_keys SET fingerprint = NULL")  # as schema v1 left it
    async with backend.open() as store:
        assert await store.append("c", [UserMessage("old message")], key="old") == [0]
        with pytest.raises(IdempotencyConflict):
            await store.append("c", [UserMessage("new message")], key="old")
        assert await store.head("c") == 0


async def test_keyed_reads_back_what_a_key_wrote_and_writes_nothing(backend: Backend) -> None:
    """What a caller asks before repeating a request it may not repeat blindly (resolve)."""
    answer = [ToolResult("call-1", "cat", "meow"), UserMessage("next")]
    big = ToolResult("call-2", "cat", "line\n" * 10_000)  # clipped: its preview comes back
    async with backend.open() as store:
        await store.append("c", [UserMessage("first")], key="send-1")
        await store.append("c", answer, key="resolve-1")
        await store.append("c", [big], key="resolve-2")
        assert await store.keyed("c", "nobody") is None
        assert await store.keyed("elsewhere", "resolve-1") is None  # keys are per conversation
        got = await store.keyed("c", "resolve-1")
        assert got is not None
        assert [(e.position, e.body) for e in got] == [(1, answer[0]), (2, answer[1])]
        [clipped] = await store.keyed("c", "resolve-2") or []
        assert clipped.position == 3 and isinstance(clipped.body, ToolResult)
        assert clipped.body.artifact is not None and clipped.body.full_size == len(big.content)
        [first] = await store.keyed("c", "send-1") or []
        assert first.body == UserMessage("first")
        assert await store.head("c") == 3
