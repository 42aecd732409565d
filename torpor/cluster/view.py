"""The cluster as an admin sees it: members, the lease table, this node's shards."""

from __future__ import annotations

from datetime import datetime

import msgspec

__all__ = ["ClusterView", "LeaseInfo", "MemberInfo", "ShardRoute"]


class MemberInfo(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    incarnation: int
    address: str
    lease_until: datetime
    live: bool  # its lease is in the future by the database's clock
    departing: bool = False  # leaving gracefully: handing its shards off, taking none


class LeaseInfo(msgspec.Struct, frozen=True, kw_only=True):
    shard: int
    owner: str | None
    owner_incarnation: int | None
    epoch: int
    lease_until: datetime | None
    live: bool  # held by a lease still in the future
    address: str | None  # the owner's address, if that incarnation is still registered


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    incarnation: int
    address: str
    shard_count: int
    shards: dict[int, int]  # shards this node serves -> their epochs
    leaving: tuple[int, ...]  # being handed off
    serving: bool  # the last renewal is recent enough to serve
    fenced_appends: int  # appends the database refused: this node's epoch was stale
    takeovers: int  # shards this node took from an expired lease of another node
    members: tuple[MemberInfo, ...]
    leases: tuple[LeaseInfo, ...]


class ShardRoute(msgspec.Struct, frozen=True, kw_only=True):
    """Where this node sends a request for one conversation now, by its lease cache (no
    database read; the cache is refreshed about every second)."""

    node_id: str  # this node
    shard: int  # the conversation's
    serving: bool  # this node serves it
    moving: bool  # in hand-off through this node: leaving it, or about to be acquired by it
    owner: str | None  # where to send it when not served here (None: no live node known)
