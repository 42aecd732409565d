"""Deleting a conversation on PostgreSQL, and setting its title and metadata.

One transaction on a pooled connection, beside the group commit (a delete is
rare, and its many statements would widen the batch's one). It locks the
conversation rows of the tree (the conversation and its sub-agent conversations,
:mod:`torpor.store.erase`) ``FOR UPDATE`` in key order, as a batch does, so an
append to one of them waits for the delete and then finds no row. A clustered
node first checks, in the same transaction, that it still holds the lease epoch
of every shard involved (``FOR SHARE``: a takeover waits for it, and it sees a
takeover that committed first), as every write of a node does.

Rows and index entries are gone at commit; their dead tuples stay in the table
files until VACUUM reclaims them (and after that in free space until it is
reused): PostgreSQL promises no overwrite of the bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import msgspec

from torpor.errors import FencedError
from torpor.store.erase import KEYED_TABLES, child_links, links_back
from torpor.store.listing import Deletion

__all__ = ["delete_tree", "describe"]

_EPOCH = "SELECT epoch FROM shard_leases WHERE shard = $1 FOR SHARE"
_KEY = "SELECT key FROM conversations WHERE external_id = $1"
_SPAWNED = "SELECT position, body FROM events WHERE conversation_id = $1 AND kind = 'spawned'"
_FIRST = "SELECT body FROM events WHERE conversation_id = $1 AND position = 0"
_LOCK = "SELECT key FROM conversations WHERE key = ANY($1::bigint[]) ORDER BY key FOR UPDATE"
_DESCRIBE = (
    "UPDATE conversations SET title = coalesce($2, title), metadata = coalesce($3, metadata) "
    "WHERE external_id = $1"
)

Fences = list[tuple[str, tuple[int, int]]]


async def _tree(conn: asyncpg.Connection, name: str, key: int) -> list[tuple[str, int]]:
    found = [(name, key)]
    seen = {name}
    index = 0
    while index < len(found):
        parent, parent_key = found[index]
        index += 1
        rows = [(int(r[0]), bytes(r[1])) for r in await conn.fetch(_SPAWNED, parent_key)]
        for child, call_id in child_links(parent, rows):
            if child in seen:
                continue
            child_key = await conn.fetchval(_KEY, child)
            if child_key is None:
                continue
            first = await conn.fetchval(_FIRST, child_key)
            if links_back(parent, call_id, child, None if first is None else bytes(first)):
                seen.add(child)
                found.append((child, int(child_key)))
    return found


def _count(status: str) -> int:
    """Rows a DELETE removed, from its command tag ("DELETE 3")."""
    return int(status.rsplit(" ", 1)[-1])


async def delete_tree(
    pool: asyncpg.Pool, name: str, by: str, now: int,
    fence_of: Callable[[str], tuple[int, int] | None],
) -> Deletion | None:
    """Delete ``name`` and its sub-agent conversations; the audit row, or None (nothing
    written) for an unknown conversation. ``fence_of(conversation)``: the (shard, epoch)
    a clustered node presents for it, or None on a single node."""
    async with pool.acquire() as conn, conn.transaction():
        key = await conn.fetchval(_KEY, name)
        if key is None:
            return None
        tree = await _tree(conn, name, int(key))
        checked: set[int] = set()
        for conversation, _ in tree:
            fence = fence_of(conversation)
            if fence is None or fence[0] in checked:
                continue
            if await conn.fetchval(_EPOCH, fence[0]) != fence[1]:
                raise FencedError(conversation, fence[0], fence[1])
            checked.add(fence[0])
        keys = sorted(k for _, k in tree)
        locked = {int(r[0]) for r in await conn.fetch(_LOCK, keys)}
        tree = [(c, k) for c, k in tree if k in locked]  # one deleted meanwhile is gone
        if not tree or tree[0][0] != name:
            return None
        keys = [k for _, k in tree]
        names = [c for c, _ in tree]
        counts: dict[str, int] = {}
        counts["events_fts"] = _count(await conn.execute(
            "DELETE FROM events_fts WHERE conversation_id = ANY($1::bigint[])", keys
        ))
        counts["pending_calls"] = _count(await conn.execute(
            "DELETE FROM pending_calls WHERE conversation = ANY($1::text[])", names
        ))
        for table in KEYED_TABLES:
            counts[table] = _count(await conn.execute(
                f"DELETE FROM {table} WHERE conversation_id = ANY($1::bigint[])", keys
            ))
        counts["conversations"] = _count(await conn.execute(
            "DELETE FROM conversations WHERE key = ANY($1::bigint[])", keys
        ))
        ids = tuple(names)
        row_id = await conn.fetchval(
            "INSERT INTO deletions (at, by, conversations, rows) VALUES ($1, $2, $3, $4) "
            "RETURNING id",
            now, by, msgspec.json.encode(ids).decode(), msgspec.json.encode(counts).decode(),
        )
    return Deletion(int(row_id), ids, counts, now, by)


async def describe(
    pool: asyncpg.Pool, name: str, title: str | None, metadata: str | None,
    fence: tuple[int, int] | None,
) -> bool:
    """Set the title and/or metadata; False when there is no such conversation."""
    async with pool.acquire() as conn, conn.transaction():
        if fence is not None and await conn.fetchval(_EPOCH, fence[0]) != fence[1]:
            raise FencedError(name, fence[0], fence[1])
        return _count(await conn.execute(_DESCRIBE, name, title, metadata)) > 0
