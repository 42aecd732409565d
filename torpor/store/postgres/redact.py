"""Redacting one event on PostgreSQL (what goes: :mod:`torpor.store.redact`).

One transaction on a pooled connection beside the group commit, as a delete
(:mod:`.delete`): the conversation row is locked ``FOR UPDATE`` (an append to it waits,
then sees the redacted row), and a clustered node first checks, in the same
transaction, that it still holds the shard's lease epoch. Rows and index entries are
gone at commit; their dead tuples stay until VACUUM (see the README).
"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import msgspec

from torpor.errors import FencedError, InvalidInput, UnknownConversation
from torpor.events import Body, decode_body, encode_body, stand_in
from torpor.store.erase import full_text
from torpor.store.listing import Deletion
from torpor.store.memory import LedgerEntry
from torpor.store.memory_rows import decode_row
from torpor.store.redact import redaction, stale_entry, stale_topic, title_of
from torpor.store.rows import decode_model_call, encode_model_call

__all__ = ["redact_event"]

_EPOCH = "SELECT epoch FROM shard_leases WHERE shard = $1 FOR SHARE"
_LOCK = "SELECT key, title FROM conversations WHERE external_id = $1 FOR UPDATE"
_EVENT = "SELECT turn, body FROM events WHERE conversation_id = $1 AND position = $2"


def _count(status: str) -> int:
    return int(status.rsplit(" ", 1)[-1])


async def redact_event(
    pool: asyncpg.Pool, name: str, position: int, reason: str, now: int,
    count: Callable[[Body], int], fence: tuple[int, int] | None,
) -> Deletion | None:
    """Redact ``position`` of ``name``; the audit row, or None when it was redacted
    already with this reason (errors as the SQLite one's; FencedError on a node that
    lost the shard)."""
    async with pool.acquire() as conn, conn.transaction():
        if fence is not None and await conn.fetchval(_EPOCH, fence[0]) != fence[1]:
            raise FencedError(name, fence[0], fence[1])
        row = await conn.fetchrow(_LOCK, name)
        if row is None:
            raise UnknownConversation(f"conversation {name!r} has no events")
        key, title = int(row[0]), row[1]
        found = await conn.fetchrow(_EVENT, key, position)
        if found is None:
            raise InvalidInput("position", f"{name!r} has no event at {position}")
        turn, data = int(found[0]), bytes(found[1])
        body = decode_body(data, conversation_id=name, position=position)
        redacted = redaction(body, position, reason, now)
        if redacted is None:
            return None
        counts: dict[str, int] = {"position": position, "events": 1}
        artifact_id = getattr(body, "artifact", None)
        artifact: bytes | None = None
        if artifact_id:
            got = await conn.fetchval("SELECT data FROM artifacts WHERE id = $1", artifact_id)
            artifact = None if got is None else bytes(got)
        text = full_text(body, artifact)  # (PostgreSQL drops its index rows by key)
        counts["events_fts"] = _count(await conn.execute(
            "DELETE FROM events_fts WHERE conversation_id = $1 AND position = $2", key, position
        ))
        counts["artifacts"] = _count(await conn.execute(
            "DELETE FROM artifacts WHERE id = $1", artifact_id
        )) if artifact_id else 0
        encoded = encode_body(redacted)
        await conn.execute(
            "UPDATE events SET body = $3, kind = 'redacted', hints = NULL, tokens = $4 "
            "WHERE conversation_id = $1 AND position = $2",
            key, position, encoded, count(stand_in(redacted)),
        )
        counts["event_vectors"] = _count(await conn.execute(
            "DELETE FROM event_vectors WHERE conversation_id = $1 AND position = $2",
            key, position,
        ))
        await _folds(conn, name, key, position, counts)
        counts["model_calls"] = await _topics(conn, name, key, turn, text)
        new_title = "" if title is not None and title == title_of(body) else title
        await conn.execute(
            "UPDATE conversations SET bytes = greatest(0, bytes - $2 + $3), title = $4 "
            "WHERE key = $1",
            key, len(data), len(encoded), new_title,
        )
        row_id = await conn.fetchval(
            "INSERT INTO deletions (at, by, conversations, rows) VALUES ($1, 'redact', $2, $3) "
            "RETURNING id",
            now, msgspec.json.encode([name]).decode(), msgspec.json.encode(counts).decode(),
        )
    return Deletion(int(row_id), (name,), counts, now, "redact")


async def _folds(
    conn: asyncpg.Connection, name: str, key: int, position: int, counts: dict[str, int]
) -> None:
    counts["checkpoints"] = _count(await conn.execute(
        "DELETE FROM checkpoints WHERE conversation_id = $1 AND position > $2", key, position
    ))
    if counts["checkpoints"]:
        await conn.execute(
            "UPDATE conversations SET checkpoint_position = (SELECT position FROM checkpoints "
            "WHERE conversation_id = $1 ORDER BY id DESC LIMIT 1) WHERE key = $1",
            key,
        )
    for table in ("memory_episodes", "memory_facts"):
        counts[table] = _count(await conn.execute(
            f"DELETE FROM {table} WHERE conversation_id = $1 AND position > $2", key, position
        ))
    stale = [
        int(r[0]) for r in await conn.fetch(
            "SELECT id, body FROM memory_ledger WHERE conversation_id = $1", key
        )
        if stale_entry(decode_row(LedgerEntry, name, int(r[0]), bytes(r[1])), position)
    ]
    if stale:
        await conn.execute("DELETE FROM memory_ledger WHERE id = ANY($1::bigint[])", stale)
    counts["memory_ledger"] = len(stale)


async def _topics(conn: asyncpg.Connection, name: str, key: int, turn: int, text: str) -> int:
    changed: list[tuple[int, bytes]] = []
    for row in await conn.fetch(
        "SELECT id, turn, body FROM model_calls WHERE conversation_id = $1 AND turn >= $2",
        key, turn,
    ):
        call = decode_model_call(name, int(row[1]), bytes(row[2]))
        if stale_topic(call.topic, text):
            cleared = msgspec.structs.replace(call, topic=None, topic_changed=None)
            changed.append((int(row[0]), encode_model_call(cleared)))
    if changed:
        await conn.executemany("UPDATE model_calls SET body = $2 WHERE id = $1", changed)
    return len(changed)
