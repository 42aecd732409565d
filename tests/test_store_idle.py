"""EventStore.idle_conversations on every backend: what retention deletes, from the index.

Least recent activity first, only those before the cut-off, bounded, and on a cluster only
those of the shards asked for.
"""

from __future__ import annotations

import pytest
from store_backends import Backend

from torpor.cluster import shard_of
from torpor.errors import InvalidInput
from torpor.events import UserMessage


async def test_lists_the_idle_least_recent_first_bounded_and_by_shard(backend: Backend) -> None:
    async with backend.open() as store:
        when = {"a": 500, "b": 100, "c": 300, "d": 2_000, "e": 200}
        for name in when:
            await store.append(name, [UserMessage(f"hello {name}")])
        for name, at in when.items():  # activity times set behind the store's back
            await backend.sql("UPDATE conversations SET updated_at = ? WHERE external_id = ?",
                              at, name)
        assert await store.idle_conversations(before=1_000) == ["b", "e", "c", "a"]
        assert await store.idle_conversations(before=300) == ["b", "e"]  # strictly before
        assert await store.idle_conversations(before=1_000, limit=2) == ["b", "e"]
        assert await store.idle_conversations(before=100) == []
        count = 4
        mine = sorted({shard_of(n, count) for n in ("a", "c")})
        kept = await store.idle_conversations(before=1_000, shards=mine, shard_count=count)
        assert kept == [n for n in ["b", "e", "c", "a"] if shard_of(n, count) in mine]
        assert await store.idle_conversations(before=1_000, shards=[], shard_count=count) == []
        with pytest.raises(InvalidInput):
            await store.idle_conversations(before=-1)
        with pytest.raises(InvalidInput):
            await store.idle_conversations(before=1_000, shards=[0])  # no shard_count
