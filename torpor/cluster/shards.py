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
from collections.abc import Iterable

from torpor.store.fence import routing_key, shard_of

__all__ = ["desired_owner", "routing_key", "shard_of"]


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
