"""What a deletion removes, the same on both backends (see ``EventStore.delete``).

Every table that keeps something about a conversation holds its integer key in
``conversation_id`` (the pending-approvals index holds its text id); the
conversation row goes last. A new table with a ``conversation_id`` column must be
added to :data:`KEYED_TABLES`: the contract test finds every such column in the
schema and fails on one that a delete leaves rows in.

Sub-agent conversations go with their parent: a parent's log holds a ``Spawned``
event naming each child (:mod:`torpor.runtime.spawn`), and a child's own log may
hold its children, so the tree is walked from the conversation down. A child counts
only while its own log still starts with the link back to that parent and call
(:func:`links_back`): a child deleted on its own frees its id, and a new conversation
that took the id since is not the parent's to delete.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from torpor.events import Body, Spawned, decode_body, searchable_text
from torpor.store.clip import artifact_of, expanded
from torpor.store.normalise import index_form

__all__ = [
    "KEYED_TABLES", "child_links", "children", "full_text", "indexed_text", "links_back"
]

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
    "schedules",
)
"""Tables keyed by the conversation's integer key, deleted by ``conversation_id``."""


def child_links(parent: str, spawned: Iterable[tuple[int, bytes]]) -> list[tuple[str, str]]:
    """(child, call id) of each child a conversation's ``spawned`` rows (position, body)
    name as its own (in a child's log the same kind names its parent, not a child)."""
    found: list[tuple[str, str]] = []
    for position, body in spawned:
        value = decode_body(bytes(body), conversation_id=parent, position=position)
        if isinstance(value, Spawned) and value.parent == parent and value.child != parent:
            found.append((value.child, value.call_id))
    return found


def children(parent: str, spawned: Iterable[tuple[int, bytes]]) -> list[str]:
    """The children a conversation's ``spawned`` rows (position, body) name as its own."""
    return [child for child, _ in child_links(parent, spawned)]


def links_back(parent: str, call_id: str, child: str, first: bytes | None) -> bool:
    """Whether ``child``'s log, whose event at position 0 is ``first``, is still the one
    ``parent`` spawned for ``call_id`` (its first event the link back)."""
    if first is None:
        return False
    value = decode_body(bytes(first), conversation_id=child, position=0)
    return isinstance(value, Spawned) and (value.parent, value.call_id) == (parent, call_id)


def full_text(body: Body, artifact: bytes | None) -> str:
    """``body``'s searchable text in full, before clipping (``artifact``: the stored full
    content, zlib-compressed, if clipped)."""
    if artifact is not None and artifact_of(body) is not None:
        body = expanded(body, zlib.decompress(artifact).decode())
    return searchable_text(body)


def indexed_text(body: Body, artifact: bytes | None) -> str:
    """The exact text an append gave the full-text index for ``body`` (its
    :func:`~torpor.store.normalise.index_form`, as ``PreparedEvent.text``): an SQLite
    entry is removed by giving the index this text again."""
    return index_form(full_text(body, artifact))
