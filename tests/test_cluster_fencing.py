"""Every write of a stale owner is fenced, not only its appends (issue 12 review).

Against a real throwaway PostgreSQL. A node that lost a shard (another node's
acquisition moved the epoch on) may still be finishing a fold or a sweep: its
checkpoint would become the conversation's latest (checkpoints are ordered by
insertion), regressing revival to an older fold; its ledger decisions and
model-call rows would land beside the new owner's. Each is refused with
FencedError, inside the write's own transaction, and writes nothing.
"""

from __future__ import annotations

import pytest

import torpor
from torpor import AssistantMessage, NodeConfig, Runtime, UserMessage
from torpor.cluster import shard_of
from torpor.store.memory import LedgerEntry
from torpor.store.protocol import Checkpoint, ModelCall

asyncpg = pytest.importorskip("asyncpg")

from tests.test_cluster_leases import (  # noqa: E402
    SHARDS,
    FixedFence,
    ids_in_distinct_shards,
    leases_table,
    torpor_cli,
)
from torpor.store.postgres import PostgresStore  # noqa: E402


def checkpoint(cid: str, position: int, cycle: int) -> Checkpoint:
    return Checkpoint(cid, position, 0, cycle)


def model_call(cid: str) -> ModelCall:
    return ModelCall(cid, 1, 0, 0, b"", "h", {}, 0, 0.0)


async def test_a_stale_owners_checkpoint_ledger_and_audit_rows_are_fenced(pg_url: str) -> None:
    await leases_table(pg_url)
    (cid,) = ids_in_distinct_shards(1)
    shard = shard_of(cid, SHARDS)
    old = FixedFence({s: 1 for s in range(SHARDS)})
    new = FixedFence({s: 2 for s in range(SHARDS)})
    async with PostgresStore(pg_url, fence=old) as stale:
        await stale.append(cid, [UserMessage(f"m{i}") for i in range(6)], turn=1)
        await stale.put_checkpoint(checkpoint(cid, 2, 1))
        conn = await asyncpg.connect(pg_url)
        try:  # another node takes the shard over
            await conn.execute("UPDATE shard_leases SET epoch = 2 WHERE shard = $1", shard)
        finally:
            await conn.close()
        async with PostgresStore(pg_url, fence=new) as owner:
            await owner.put_checkpoint(checkpoint(cid, 4, 2))  # the new owner's fold
            # The stale node finishes its own (older) fold and sweep afterwards.
            with pytest.raises(torpor.FencedError) as refused:
                await stale.put_checkpoint(checkpoint(cid, 3, 2))
            assert (refused.value.shard, refused.value.epoch) == (shard, 1)
            with pytest.raises(torpor.FencedError):
                await stale.record_model_call(model_call(cid))
            with pytest.raises(torpor.FencedError):
                await stale.put_artifact(cid, b"late bytes")
            with pytest.raises(torpor.FencedError):
                await stale.put_ledger(cid, [LedgerEntry("k", "delete", "item-1")])
            with pytest.raises(torpor.FencedError):
                await stale.put_turn_decision(cid, 1, "none")
            with pytest.raises(torpor.FencedError):  # an answer with its audit row: neither
                await stale._append_audited(cid, [AssistantMessage("late")], 1, 5, model_call(cid))
            assert old.refused == [(shard, 1)] * 6
            latest = await owner.latest_checkpoint(cid)
            assert latest is not None and (latest.position, latest.cycle) == (4, 2)
            record = await owner.memory(cid)
            assert record.ledger == () and record.skipped_turns == ()
            # The current owner's own writes of each kind go through.
            await owner.record_model_call(model_call(cid))
            await owner.put_turn_decision(cid, 1, "none")
            answer = await owner._append_audited(
                cid, [AssistantMessage("a")], 1, 5, model_call(cid)
            )
            assert [e.position for e in answer] == [6]
            assert (await owner.memory(cid)).skipped_turns == (1,)
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM model_calls") == 2  # the owner's
        assert await conn.fetchval("SELECT count(*) FROM events") == 7
        assert await conn.fetchval("SELECT count(*) FROM artifacts") == 0
    finally:
        await conn.close()


async def test_a_store_without_a_node_on_a_cluster_database_reads_but_refuses_every_write(
    pg_url: str,
) -> None:
    async with PostgresStore(pg_url) as before:  # no cluster yet: a single node writes
        await before.append("solo", [UserMessage("before the cluster")], turn=1)
    node = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=5.0, shards=SHARDS)
    async with Runtime(pg_url, node=node) as rt:
        await (await rt.send("solo", "from the node")).result()
        head = await rt.store.head("solo")
        async with PostgresStore(pg_url) as plain:
            with pytest.raises(torpor.FencedError, match="node=") as refused:
                await plain.append("solo", [UserMessage("unfenced")], turn=3)
            assert refused.value.epoch is None
            assert refused.value.shard == shard_of("solo", SHARDS)
            with pytest.raises(torpor.FencedError):
                await plain.put_checkpoint(checkpoint("solo", 1, 1))
            with pytest.raises(torpor.FencedError):
                await plain.put_turn_decision("solo", 1, "none")
            # Reads keep working, and nothing of the refused writes landed.
            assert head is not None and await plain.head("solo") == head
            assert await plain.latest_checkpoint("solo") is None
        code, out, err = await torpor_cli("inspect", "--db", pg_url, "solo")
        assert code == 0, err
        assert "from the node" in out


async def test_a_fenced_revival_is_not_retried_forever_the_agent_is_dropped(pg_url: str) -> None:
    async with PostgresStore(pg_url) as before:  # a turn cut off before the cluster came
        await before.append("cut", [UserMessage("unanswered")], turn=1)
    node = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=5.0, shards=SHARDS)
    async with Runtime(pg_url, node=node), Runtime(pg_url) as plain:
        # A cluster's database without node=: it may read, not write, so nothing is owed
        # to its log here and nothing is re-driven as it starts.
        assert plain.store.read_only and not plain._redrive._runs
        # Revival owes the log an Aborted for the cut turn; this runtime may not write it.
        for _ in range(2):
            with pytest.raises(torpor.FencedError):
                await plain.send("cut", "again")
            # Dropped, not scheduled to retry the refused write with backoff forever.
            assert plain._registry.get("cut") is None
            assert not plain._supervisor.tasks
        assert await plain.store.head("cut") == 0
