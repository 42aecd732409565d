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

__all__ = ["Fence", "routing_key", "shard_of"]


def routing_key(conversation_id: str) -> str:
    """What picks a conversation's shard: the text between its first ``{`` and the
    next ``}`` when there is some (a hash tag, as in Redis Cluster), else the whole
    id. ``{p}/call-1`` routes as ``p`` does: a sub-agent lives on its parent's shard."""
    start = conversation_id.find("{")
    if start >= 0:
        end = conversation_id.find("}", start + 1)
        if end > start + 1:
            return conversation_id[start + 1:end]
    return conversation_id


def shard_of(conversation_id: str, shards: int) -> int:
    """The conversation's shard: CRC-32 of its UTF-8 routing key (stable across
    processes, unlike ``hash()``), modulo the cluster's shard count. Here, not in
    torpor.cluster, because the store needs it too (to name the shard a node-less write
    was refused for)."""
    key = routing_key(conversation_id)
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % shards


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
