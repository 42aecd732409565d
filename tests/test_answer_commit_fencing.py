"""The answer-and-audit operation on a PostgreSQL cluster: a stale owner writes neither row."""

from __future__ import annotations

import pytest

import torpor
from torpor import AssistantMessage, UserMessage
from torpor.cluster import shard_of
from torpor.store.protocol import ModelCall

asyncpg = pytest.importorskip("asyncpg")

from tests.test_cluster_leases import (  # noqa: E402
    SHARDS,
    FixedFence,
    ids_in_distinct_shards,
    leases_table,
)
from torpor.store.postgres import PostgresStore  # noqa: E402


async def test_a_stale_owners_answer_and_its_audit_row_are_fenced_together(pg_url: str) -> None:
    await leases_table(pg_url)
    (cid,) = ids_in_distinct_shards(1)
    shard = shard_of(cid, SHARDS)
    call = ModelCall(cid, 1, 0, 0, b"\x90", "h", {"tail": 1}, 1, 0.1)
    old = FixedFence({s: 1 for s in range(SHARDS)})
    new = FixedFence({s: 2 for s in range(SHARDS)})
    async with PostgresStore(pg_url, fence=old) as stale:
        await stale.append(cid, [UserMessage("q")], turn=1)
        conn = await asyncpg.connect(pg_url)
        try:  # another node takes the shard over
            await conn.execute("UPDATE shard_leases SET epoch = 2 WHERE shard = $1", shard)
        finally:
            await conn.close()
        with pytest.raises(torpor.FencedError):
            await stale._append_audited(cid, [AssistantMessage("late")], 1, 0, call)
        assert old.refused == [(shard, 1)]
        async with PostgresStore(pg_url, fence=new) as owner:
            events = await owner._append_audited(cid, [AssistantMessage("a")], 1, 0, call)
            assert [e.position for e in events] == [1]
            assert len(await owner.model_calls(cid)) == 1
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM model_calls") == 1
        assert await conn.fetchval("SELECT count(*) FROM events") == 2
    finally:
        await conn.close()
