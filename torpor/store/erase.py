"""What a deletion removes, the same on both backends (see ``EventStore.delete``).

Every table that keeps something about a conversation holds its integer key in
``conversation_id`` (the pending-approvals index holds its text id); the
conversation row goes last. A new table with a ``conversation_id`` column must be
added to :data:`KEYED_TABLES`: the contract test finds every such column in the
schema and fails on one that a delete leaves rows in.

Sub-agent conversations go with their parent: a parent's log holds a ``Spawned``
event naming each child (:mod:`torpor.runtime.spawn`), and a child's own log may
hold its children, so the tree is walked from the conversation down.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from torpor.events import Body, Spawned, decode_body, searchable_text
from torpor.store.clip import artifact_of, expanded

__all__ = ["KEYED_TABLES", "children", "indexed_text"]

KEYED_TABLES: tuple[str, ...] = (
    "events",
    "checkpoints",
    "artifacts",
    "idempotency_keys",
    "model_calls",
    "memory_episodes",
    "memory_facts",
    "memory_ledger",
    "memory_turns",
    "event_vectors",
    "vector_progress",
)
"""Tables keyed by the conversation's integer key, deleted by ``conversation_id``."""


def children(parent: str, spawned: Iterable[tuple[int, bytes]]) -> list[str]:
    """The children a conversation's ``spawned`` rows (position, body) name as its own
    (in a child's log the same kind names its parent, which is not a child)."""
    found: list[str] = []
    for position, body in spawned:
        value = decode_body(bytes(body), conversation_id=parent, position=position)
        if isinstance(value, Spawned) and value.parent == parent and value.child != parent:
            found.append(value.child)
    return found


def indexed_text(body: Body, artifact: bytes | None) -> str:
    """The text an append gave the full-text index for ``body`` (the full text, before
    clipping: ``artifact`` is the stored full content, zlib-compressed, if clipped)."""
    if artifact is not None and artifact_of(body) is not None:
        body = expanded(body, zlib.decompress(artifact).decode())
    return searchable_text(body)
