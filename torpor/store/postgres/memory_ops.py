"""Derived memory on PostgreSQL: one transaction per write on a pooled connection, one read.

Memory writes are rare (a fold, a sweep, a turn a reconciler skipped) and never
move a head, so they go beside the group commit instead of widening its one
statement; items are keyed by deterministic ids (``ON CONFLICT DO NOTHING``),
so a retried fold writes nothing twice; a fold first drops what an attempt
whose checkpoint never landed left after the previous checkpoint.
"""

from __future__ import annotations

import asyncpg

from torpor.errors import FencedError, MemoryChanged, UnknownConversation
from torpor.store.memory import MemoryRecord
from torpor.store.memory_rows import MemoryWrite, record

__all__ = ["read_memory", "write_memory"]

_KEY = "SELECT key FROM conversations WHERE external_id = $1"
# A write locks the row (a delete or a redaction, which lock it FOR UPDATE, wait for it or
# it for them), so it never lands in a conversation deleted after its check.
_LOCK = "SELECT key FROM conversations WHERE external_id = $1 FOR SHARE"
# The named items that are not stored, of (position, ordinal; -1 for an episode) pairs.
_MISSING = """
SELECT p, o FROM unnest($2::bigint[], $3::int[]) AS n(p, o)
WHERE NOT CASE WHEN o < 0
    THEN EXISTS (SELECT 1 FROM memory_episodes WHERE conversation_id = $1 AND position = p)
    ELSE EXISTS (SELECT 1 FROM memory_facts
                 WHERE conversation_id = $1 AND position = p AND ordinal = o) END
"""
# A clustered node's memory write checks its lease epoch in its own transaction (FOR
# SHARE: a takeover waits for it, and it sees a takeover that committed first).
_EPOCH = "SELECT epoch FROM shard_leases WHERE shard = $1 FOR SHARE"

_EPISODES = """
INSERT INTO memory_episodes (conversation_id, position, created_at, body)
SELECT $1, * FROM unnest($2::bigint[], $3::bigint[], $4::bytea[])
ON CONFLICT DO NOTHING
"""
_FACTS = """
INSERT INTO memory_facts (conversation_id, position, ordinal, key, created_at, body)
SELECT $1, * FROM unnest($2::bigint[], $3::int[], $4::text[], $5::bigint[], $6::bytea[])
ON CONFLICT DO NOTHING
"""
# Items after the given position that no checkpoint backs: a fold that never landed. A
# checkpointed fold's items are never dropped (not even by a stale writer on a cluster).
_UNBACKED = """conversation_id = $1 AND position > $2 AND position NOT IN
(SELECT position FROM checkpoints WHERE conversation_id = $1)"""
_DROP_EPISODES = f"DELETE FROM memory_episodes WHERE {_UNBACKED}"
_DROP_FACTS = f"DELETE FROM memory_facts WHERE {_UNBACKED}"
_LEDGER = """
INSERT INTO memory_ledger (conversation_id, key, created_at, body)
SELECT $1, k, c, b FROM unnest($2::text[], $3::bigint[], $4::bytea[])
    WITH ORDINALITY AS u(k, c, b, n) ORDER BY n
"""
_TURNS = """
INSERT INTO memory_turns (conversation_id, turn, decision, created_at)
SELECT $1, * FROM unnest($2::int[], $3::text[], $4::bigint[])
ON CONFLICT (conversation_id, turn) DO UPDATE
SET decision = excluded.decision, created_at = excluded.created_at
"""
# The latest decision of every key stays; of the rest, the newest ``$2`` rows.
_PRUNE = """
DELETE FROM memory_ledger WHERE conversation_id = $1
AND id NOT IN (SELECT max(id) FROM memory_ledger WHERE conversation_id = $1 GROUP BY key)
AND id NOT IN (SELECT id FROM memory_ledger WHERE conversation_id = $1
               ORDER BY id DESC LIMIT $2)
"""


def _columns(rows: tuple[tuple[object, ...], ...], width: int) -> list[list[object]]:
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


async def write_memory(
    pool: asyncpg.Pool, write: MemoryWrite, fence: tuple[int, int] | None = None
) -> None:
    """``fence``: the (shard, epoch) a clustered node holds; a stale one writes nothing
    (:class:`~torpor.errors.FencedError`): a ledger decision or a skipped turn from a
    node that lost the conversation must not land beside the new owner's."""
    async with pool.acquire() as conn, conn.transaction():
        if fence is not None and await conn.fetchval(_EPOCH, fence[0]) != fence[1]:
            raise FencedError(write.conversation_id, fence[0], fence[1])
        key = await conn.fetchval(_LOCK, write.conversation_id)
        if key is None:  # deleted meanwhile (or never was): nothing is created
            raise UnknownConversation(f"no conversation {write.conversation_id!r} to remember")
        if write.named:
            missing = await conn.fetch(_MISSING, key, *_columns(write.named, 2))
            if missing:
                raise MemoryChanged(write.conversation_id, tuple(
                    f"episode:{p}" if o < 0 else f"{p}.{o}" for p, o in missing
                ))
        if write.replace_after is not None:
            await conn.execute(_DROP_EPISODES, key, write.replace_after)
            await conn.execute(_DROP_FACTS, key, write.replace_after)
        if write.episodes:
            await conn.execute(_EPISODES, key, *_columns(write.episodes, 3))
        if write.facts:
            await conn.execute(_FACTS, key, *_columns(write.facts, 5))
        if write.ledger:
            await conn.execute(_LEDGER, key, *_columns(write.ledger, 3))
        if write.turns:
            await conn.execute(_TURNS, key, *_columns(write.turns, 3))
        if write.prune_tail is not None:
            await conn.execute(_PRUNE, key, write.prune_tail)


async def read_memory(pool: asyncpg.Pool, name: str) -> MemoryRecord:
    """Every item, ledger row and skipped turn of one conversation, from one snapshot."""
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                        readonly=True):
        key = await conn.fetchval(_KEY, name)
        if key is None:
            return MemoryRecord(name)
        episodes = await conn.fetch(
            "SELECT position, body FROM memory_episodes WHERE conversation_id = $1 "
            "ORDER BY position", key)
        facts = await conn.fetch(
            "SELECT position, body FROM memory_facts WHERE conversation_id = $1 "
            "ORDER BY position, ordinal", key)
        ledger = await conn.fetch(
            "SELECT id, body FROM memory_ledger WHERE conversation_id = $1 ORDER BY id", key)
        turns = await conn.fetch(
            "SELECT turn FROM memory_turns WHERE conversation_id = $1 AND decision = 'none' "
            "ORDER BY turn", key)
    return record(
        name,
        ((int(r[0]), bytes(r[1])) for r in episodes),
        ((int(r[0]), bytes(r[1])) for r in facts),
        ((int(r[0]), bytes(r[1])) for r in ledger),
        (int(r[0]) for r in turns),
    )
