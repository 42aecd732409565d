"""The fence a clustered node hands its store: which lease epoch each write presents.

The store knows nothing of nodes or membership (``torpor.cluster`` implements
this); it only asks, when it builds an append, which shard the conversation is
in and which epoch of that shard's lease this node holds, writes that epoch
into the batch's lease check, and reports back when the database refused it.
Without a fence (single node) the store writes exactly as before.
"""

from __future__ import annotations

import zlib
from typing import Protocol

__all__ = ["Fence", "shard_of"]


def shard_of(conversation_id: str, shards: int) -> int:
    """The conversation's shard: CRC-32 of its UTF-8 id (stable across processes, unlike
    ``hash()``), modulo the cluster's shard count. Here, not in torpor.cluster, because
    the store needs it too (to name the shard a node-less write was refused for)."""
    return zlib.crc32(conversation_id.encode("utf-8", "surrogatepass")) % shards


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
