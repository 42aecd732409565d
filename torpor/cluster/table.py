"""The lease table and the members, read from the database (admin views, ``torpor inspect``)."""

from __future__ import annotations

from typing import Any

from torpor.cluster import sql
from torpor.cluster.view import LeaseInfo, MemberInfo

__all__ = ["read_table"]


async def read_table(conn: Any) -> tuple[tuple[MemberInfo, ...], tuple[LeaseInfo, ...]]:
    """Every node row and every lease row, as the database's clock sees them now.

    Empty on a database no node has joined (the tables exist from schema version 4).
    """
    nodes = await conn.fetch(sql.NODES)
    rows = await conn.fetch(sql.LEASES)
    members = tuple(
        MemberInfo(node_id=n[0], incarnation=n[1], address=n[2], lease_until=n[3], live=n[4],
                   departing=n[5])
        for n in nodes
    )
    leases = tuple(
        LeaseInfo(shard=r[0], owner=r[1], owner_incarnation=r[2], epoch=r[3],
                  lease_until=r[4], live=r[5], address=r[6])
        for r in rows
    )
    return members, leases
