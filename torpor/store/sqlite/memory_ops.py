"""Derived memory on SQLite: the write operation the group commit runs, and the read.

Writes go through the one writer like every other (so they commit with the
batch they land in); items are keyed by deterministic ids, so a retried fold
writes nothing twice (``INSERT OR IGNORE``), and a fold first drops what an
attempt whose checkpoint never landed left after the previous checkpoint.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgspec

from torpor.errors import MemoryChanged, UnknownConversation
from torpor.store.memory import MemoryRecord
from torpor.store.memory_rows import MemoryWrite, record
from torpor.store.sqlite.batch import Batch, ConvState, Plan
from torpor.store.sqlite.reads import _snapshot

__all__ = ["MemoryOp", "read_memory"]

_KEY = "(SELECT key FROM conversations WHERE external_id = ?)"

INSERT_EPISODE = (
    "INSERT OR IGNORE INTO memory_episodes (conversation_id, position, created_at, body) "
    "VALUES (?, ?, ?, ?)"
)
INSERT_FACT = (
    "INSERT OR IGNORE INTO memory_facts "
    "(conversation_id, position, ordinal, key, created_at, body) VALUES (?, ?, ?, ?, ?, ?)"
)
# Items after the given position that no checkpoint backs: a fold that never landed. A
# checkpointed fold's items are never dropped (not even by a stale writer on a cluster).
_UNBACKED = (
    "conversation_id = ?1 AND position > ?2 AND position NOT IN "
    "(SELECT position FROM checkpoints WHERE conversation_id = ?1)"
)
DROP_EPISODES = f"DELETE FROM memory_episodes WHERE {_UNBACKED}"
DROP_FACTS = f"DELETE FROM memory_facts WHERE {_UNBACKED}"
INSERT_LEDGER = (
    "INSERT INTO memory_ledger (conversation_id, key, created_at, body) VALUES (?, ?, ?, ?)"
)
# The latest decision of every key stays; of the rest, the newest ``tail`` rows.
PRUNE_LEDGER = (
    "DELETE FROM memory_ledger WHERE conversation_id = ?1 AND id NOT IN "
    "(SELECT max(id) FROM memory_ledger WHERE conversation_id = ?1 GROUP BY key) "
    "AND id NOT IN (SELECT id FROM memory_ledger WHERE conversation_id = ?1 "
    "ORDER BY id DESC LIMIT ?2)"
)
_FACT_STORED = (
    "SELECT 1 FROM memory_facts WHERE conversation_id = ? AND position = ? AND ordinal = ?"
)
_EPISODE_STORED = "SELECT 1 FROM memory_episodes WHERE conversation_id = ? AND position = ?"
INSERT_TURN = (
    "INSERT OR REPLACE INTO memory_turns (conversation_id, turn, decision, created_at) "
    "VALUES (?, ?, ?, ?)"
)

Row = tuple[Any, ...]


class MemoryOp(msgspec.Struct, frozen=True, gc=False):
    """Derived-memory rows of one conversation, which must exist already."""

    write: MemoryWrite

    @property
    def conversation_id(self) -> str:
        return self.write.conversation_id

    def plan(self, batch: Batch) -> Plan:
        w = self.write
        state = batch.conversation(w.conversation_id)
        if not state.stored:  # deleted meanwhile (or never was): nothing is created
            raise UnknownConversation(f"no conversation {w.conversation_id!r} to remember")
        key = state.key
        missing = [
            f"episode:{p}" if o < 0 else f"{p}.{o}"
            for p, o in w.named
            if batch.conn.execute(
                *((_EPISODE_STORED, (key, p)) if o < 0 else (_FACT_STORED, (key, p, o)))
            ).fetchone() is None
        ]
        if missing:
            raise MemoryChanged(w.conversation_id, tuple(missing))
        writes: list[tuple[str, Row]] = []
        if w.replace_after is not None:
            writes.append((DROP_EPISODES, (key, w.replace_after)))
            writes.append((DROP_FACTS, (key, w.replace_after)))
        writes.extend((INSERT_EPISODE, (key, *row)) for row in w.episodes)
        writes.extend((INSERT_FACT, (key, *row)) for row in w.facts)
        writes.extend((INSERT_LEDGER, (key, *row)) for row in w.ledger)
        writes.extend((INSERT_TURN, (key, *row)) for row in w.turns)
        if w.prune_tail is not None:
            writes.append((PRUNE_LEDGER, (key, w.prune_tail)))
        return Plan(None, w.conversation_id, ConvState(key, state.head), writes)


def read_memory(conn: sqlite3.Connection, name: str) -> MemoryRecord:
    """Every item, ledger row and skipped turn of one conversation, from one snapshot."""

    def read() -> MemoryRecord:
        def rows(sql: str) -> list[Any]:
            return conn.execute(sql, (name,)).fetchall()

        where = f"WHERE conversation_id = {_KEY}"
        episodes = rows(f"SELECT position, body FROM memory_episodes {where} ORDER BY position")
        facts = rows(
            f"SELECT position, body FROM memory_facts {where} ORDER BY position, ordinal"
        )
        ledger = rows(f"SELECT id, body FROM memory_ledger {where} ORDER BY id")
        turns = rows(f"SELECT turn FROM memory_turns {where} AND decision = 'none' ORDER BY turn")
        return record(name, episodes, facts, ledger, (t for (t,) in turns))

    return _snapshot(conn, read)
