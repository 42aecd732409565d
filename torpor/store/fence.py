"""The fence a clustered node hands its store: which lease epoch each write presents.

The store knows nothing of nodes or membership (``torpor.cluster`` implements
this); it only asks, when it builds an append, which shard the conversation is
in and which epoch of that shard's lease this node holds, writes that epoch
into the batch's lease check, and reports back when the database refused it.
Without a fence (single node) the store writes exactly as before.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Fence"]


class Fence(Protocol):
    @property
    def idle_timeout(self) -> float:
        """Seconds a transaction may sit idle before the server ends it (a stopped
        process must not keep its lock on a lease row)."""
        ...

    def hold(self, conversation_id: str) -> tuple[int, int]:
        """``(shard, epoch)`` to present for a write to ``conversation_id``.

        Raises :class:`~torpor.errors.FencedError` when this node has no epoch
        for that shard (it never held it, or released it).
        """
        ...

    def fenced(self, shard: int, epoch: int) -> None:
        """The database refused ``epoch`` for ``shard``: another node holds it now.
        Must not block (called from the writer's callers)."""
        ...
