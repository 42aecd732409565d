"""Which shard a conversation is in, and which node should own each shard.

Both are pure functions every node computes identically: the shard is a
stable hash of the conversation id's routing key (CRC-32 of its UTF-8 bytes,
never Python's per-process ``hash()``): the whole id, or, as with Redis
Cluster's hash tags, only the text inside its first ``{...}``, so that a
sub-agent ``{p}/call-1`` lives on its parent ``p``'s shard (:func:`routing_key`);
and the desired owner is chosen by rendezvous (highest-random-weight) hashing
over the live nodes, so a node joining or leaving moves only the shards it wins
or held. The lease row, not this
function, says who owns a shard right now.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable

__all__ = ["desired_owner", "routing_key", "shard_of"]


def routing_key(conversation_id: str) -> str:
    """What picks a conversation's shard: the text between its first ``{`` and the
    next ``}`` when there is some (a hash tag), else the whole id. ``{p}`` and
    ``{p}/call-1`` share a tag; an id with no tag routes as its own tag would, so
    ``p`` routes with them too."""
    start = conversation_id.find("{")
    if start >= 0:
        end = conversation_id.find("}", start + 1)
        if end > start + 1:
            return conversation_id[start + 1:end]
    return conversation_id


def shard_of(conversation_id: str, shards: int) -> int:
    key = routing_key(conversation_id)
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % shards


def _weight(node_id: str, shard: int) -> bytes:
    return hashlib.blake2b(f"{shard}\x00{node_id}".encode(), digest_size=8).digest()


def desired_owner(shard: int, nodes: Iterable[str]) -> str | None:
    """The live node that should hold ``shard`` (None when there is none)."""
    best: str | None = None
    best_weight = b""
    for node in nodes:
        weight = _weight(node, shard)
        if best is None or (weight, node) > (best_weight, best):
            best, best_weight = node, weight
    return best
